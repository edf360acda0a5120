"""Character LSTM language model (FOSI's LM task; haiku's RNN example).

one_hot(128) → LSTM(256) → ReLU → LSTM(256) → MLP [256 (ReLU), 128] applied per time step;
1,018,240 parameters. The LSTM cell is written out here rather than taken from ``nn.LSTM``:

* haiku's cell is one Linear on ``concat[x, h]`` producing the gates in the order (i, g, f, o),
  with **+1 added to the forget-gate pre-activation** (not stored in the bias), ``c' = σ(f+1)·c +
  σ(i)·tanh(g)``, ``h' = σ(o)·tanh(c')``; ``nn.LSTM`` has two biases, the order (i, f, g, o) and no
  forget offset;
* FOSI's Lanczos needs Hessian-vector products by forward-over-reverse AD, which cuDNN's fused
  RNN kernels do not support; plain tensor ops do.

Initialisation follows haiku: truncated normal (±2σ) with σ = 1/√fan_in, zero biases, zero
initial state per sequence. The one-hot input times the input half of the gate matrix is computed
as an embedding lookup (same function and gradients, 128× fewer FLOPs); ``input_lookup=False``
uses the literal one-hot product.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _haiku_linear_init_(weight: Tensor, bias: Tensor | None, fan_in: int) -> None:
    std = 1.0 / math.sqrt(fan_in)
    nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)
    if bias is not None:
        nn.init.zeros_(bias)


class HaikuLSTM(nn.Module):
    """One LSTM layer, batch-first, gates from a single ``(4H, in + H)`` matrix (haiku's cell).

    Args:
        input_size: Input features per step.
        hidden_size: Hidden size H.
        forget_bias: Constant added to the forget-gate pre-activation (haiku: 1).
    """

    def __init__(self, input_size: int, hidden_size: int, forget_bias: float = 1.0) -> None:
        super().__init__()
        self.input_size, self.hidden_size, self.forget_bias = input_size, hidden_size, forget_bias
        self.weight = nn.Parameter(torch.empty(4 * hidden_size, input_size + hidden_size))
        self.bias = nn.Parameter(torch.empty(4 * hidden_size))
        _haiku_linear_init_(self.weight, self.bias, input_size + hidden_size)

    def forward(self, x_proj: Tensor) -> Tensor:
        """Run the recurrence from a zero state.

        Args:
            x_proj: The input half of the gate pre-activations, ``(B, T, 4H)``, bias included
                (:meth:`project_inputs`).

        Returns:
            The hidden states ``(B, T, H)``.
        """
        b, t, _ = x_proj.shape
        hsz = self.hidden_size
        w_h = self.weight[:, self.input_size :]
        h = x_proj.new_zeros(b, hsz)
        c = x_proj.new_zeros(b, hsz)
        outputs = []
        # unbind, not x_proj[:, step]: the backward of each indexing op is a zero-filled (B, T, 4H)
        # tensor, T of them per layer, which cost ~85 % of a training step on a CPU (torch profiler:
        # aten::fill_ under select_backward); unbind's backward is one stack of the T slices.
        x_steps = x_proj.unbind(1)
        for step in range(t):
            gates = x_steps[step] + h @ w_h.t()
            i, g, f, o = gates.split(hsz, dim=-1)
            c = torch.sigmoid(f + self.forget_bias) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        return torch.stack(outputs, dim=1)

    def project_inputs(self, x: Tensor) -> Tensor:
        """Input half of the gate pre-activations (bias included) for a dense input.

        Args:
            x: ``(B, T, input_size)``.

        Returns:
            ``(B, T, 4H)``.
        """
        return F.linear(x, self.weight[:, : self.input_size], self.bias)


class CharLSTM(nn.Module):
    """The character LSTM of the module docstring.

    Args:
        vocab_size: Number of byte values (input one-hot size and output classes).
        hidden_size: Hidden size of both LSTM layers.
        mlp_hidden: Width of the per-step MLP's hidden layer.
        forget_bias: Forget-gate offset of both LSTM layers.
        input_lookup: Compute the one-hot input product as an embedding lookup (same function).
    """

    def __init__(
        self,
        vocab_size: int = 128,
        hidden_size: int = 256,
        mlp_hidden: int = 256,
        forget_bias: float = 1.0,
        input_lookup: bool = True,
    ) -> None:
        super().__init__()
        self.vocab_size, self.input_lookup = vocab_size, input_lookup
        self.lstm1 = HaikuLSTM(vocab_size, hidden_size, forget_bias)
        self.lstm2 = HaikuLSTM(hidden_size, hidden_size, forget_bias)
        self.fc1 = nn.Linear(hidden_size, mlp_hidden)
        self.fc2 = nn.Linear(mlp_hidden, vocab_size)
        _haiku_linear_init_(self.fc1.weight, self.fc1.bias, hidden_size)
        _haiku_linear_init_(self.fc2.weight, self.fc2.bias, mlp_hidden)

    def forward(self, tokens: Tensor) -> Tensor:
        """Next-byte logits.

        Args:
            tokens: int64 ``(B, T)`` byte codes.

        Returns:
            Logits ``(B, T, vocab_size)``.
        """
        if self.input_lookup:
            w_x = self.lstm1.weight[:, : self.vocab_size]  # (4H, vocab): column c = one_hot(c)'s image
            x_proj = F.embedding(tokens, w_x.t()) + self.lstm1.bias
        else:
            one_hot = F.one_hot(tokens, self.vocab_size).to(self.lstm1.weight.dtype)
            x_proj = self.lstm1.project_inputs(one_hot)
        h1 = torch.relu(self.lstm1(x_proj))
        h2 = self.lstm2(self.lstm2.project_inputs(h1))
        return self.fc2(torch.relu(self.fc1(h2)))


# The Hydra target of conf/model/fosi_char_lstm.yaml and of the records that name it: the class itself.
char_lstm = CharLSTM
