"""FOSI DNN-task models: sizes, the haiku LSTM cell against an explicit reference, Hessian products
through it, TF SAME padding in MobileNetV1, the ResNet-18 head's weights and BatchNorm modes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvopt.errors import DataNotFoundError
from curvopt.models.char_lstm import CharLSTM
from curvopt.models.conv_ae import ConvAutoencoder
from curvopt.models.mobilenet import MobileNetV1, same_padding
from curvopt.models.resnet_head import ResNet18Backbone, resnet18_head
from curvopt.objective import Objective


def _count(m: nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in m.parameters() if p.requires_grad or not trainable)


def test_parameter_counts_match_the_spec():
    assert _count(ConvAutoencoder()) == 468_227
    assert _count(CharLSTM()) == 1_018_240


def test_conv_autoencoder_shape_and_range():
    out = ConvAutoencoder()(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 3, 32, 32) and out.abs().max() <= 1.0


def _reference_lstm(model: CharLSTM, tokens: torch.Tensor) -> torch.Tensor:
    """haiku's DeepRNN written out step by step: gates (i, g, f, o) from one Linear on [x, h],
    forget gate σ(f + 1)."""

    def cell(layer, x, h, c):
        gates = torch.cat([x, h], dim=-1) @ layer.weight.t() + layer.bias
        i, g, f, o = gates.chunk(4, dim=-1)
        c = torch.sigmoid(f + 1.0) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c

    b, t = tokens.shape
    hs = model.lstm1.hidden_size
    h1 = c1 = h2 = c2 = torch.zeros(b, hs, dtype=torch.float64)
    outs = []
    for s in range(t):
        x = F.one_hot(tokens[:, s], model.vocab_size).double()
        h1, c1 = cell(model.lstm1, x, h1, c1)
        h2, c2 = cell(model.lstm2, torch.relu(h1), h2, c2)
        outs.append(model.fc2(torch.relu(model.fc1(h2))))
    return torch.stack(outs, dim=1)


def test_lstm_matches_haiku_cell_reference():
    torch.manual_seed(0)
    model = CharLSTM(vocab_size=11, hidden_size=6, mlp_hidden=5).double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # non-zero biases so the gate order matters
    tokens = torch.randint(0, 11, (3, 7))
    torch.testing.assert_close(model(tokens), _reference_lstm(model, tokens))
    model.input_lookup = False
    torch.testing.assert_close(model(tokens), _reference_lstm(model, tokens))


def test_lstm_backward_has_no_per_step_index_nodes():
    """The recurrence reads its input slices through one unbind, not T indexing ops: each
    ``SelectBackward0`` fills a zero (B, T, 4H) gradient, which made the backward ~85 % of an LM
    training step on a CPU. The graph must hold no such node (the gradients are the same either way:
    the haiku-cell reference test above)."""
    model = CharLSTM(vocab_size=9, hidden_size=5, mlp_hidden=4)
    out = model(torch.randint(0, 9, (2, 6)))
    seen, stack, names = set(), [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack += [n for n, _ in node.next_functions]
    assert "UnbindBackward0" in names and "SelectBackward0" not in names


def test_lstm_forward_over_reverse_hvp_equals_double_backward():
    torch.manual_seed(1)
    model = CharLSTM(vocab_size=9, hidden_size=5, mlp_hidden=4).double()
    obj = Objective(model, "cross_entropy")
    x, y = torch.randint(0, 9, (2, 6)), torch.randint(0, 9, (2, 6))
    params = obj.params()
    v = {k: torch.randn_like(t) for k, t in params.items()}
    hv = obj.hvp(params, x, y, v)
    loss = F.cross_entropy(model(x).reshape(-1, 9), y.reshape(-1))
    names = list(params)
    grads = torch.autograd.grad(loss, [dict(model.named_parameters())[n] for n in names], create_graph=True)
    ref = torch.autograd.grad(
        grads, [dict(model.named_parameters())[n] for n in names], [v[n] for n in names]
    )
    for n, r in zip(names, ref, strict=True):
        torch.testing.assert_close(hv[n], r)


@pytest.mark.parametrize(
    ("size", "k", "s", "expect"),
    [(32, 3, 2, (0, 1)), (47, 3, 2, (1, 1)), (1, 3, 2, (1, 1)), (5, 3, 1, (1, 1))],
)
def test_tf_same_padding(size, k, s, expect):
    assert same_padding(size, k, s) == expect


def test_mobilenet_layouts():
    x = torch.randint(0, 256, (2, 3, 96, 64), dtype=torch.uint8)
    small = {"channels": (8, 16), "strides": (1, 2)}
    faithful = MobileNetV1(num_classes=7, **small)
    natural = MobileNetV1(num_classes=7, input_layout="natural", **small)
    assert faithful(x).shape == (2, 7) and natural(x).shape == (2, 7)
    assert faithful.stem.in_channels == 64 and natural.stem.in_channels == 3
    # faithful: H = 3 colour planes -> 1 row after the VALID stride-2 stem; W = 96 frames -> 47
    feats = faithful.stem(x.permute(0, 3, 1, 2).float())
    assert feats.shape == (2, 32, 1, 47)


@pytest.mark.slow
def test_mobilenet_size():
    assert 3_700_000 < _count(MobileNetV1()) < 3_800_000  # "approximately 4 million"; haiku: ≈3.75M


def test_resnet_head_loads_torchvision_state_dict_and_freezes_backbone(tmp_path):
    torch.manual_seed(0)
    backbone = ResNet18Backbone()
    state = dict(backbone.state_dict())
    state["fc.weight"], state["fc.bias"] = torch.zeros(1000, 512), torch.zeros(1000)
    torch.save(state, tmp_path / "resnet18-f37072fd.pth")
    model = resnet18_head(weights=str(tmp_path))
    assert model.weights_source is not None
    assert _count(model, trainable=True) == 5130
    torch.testing.assert_close(model.backbone.conv1.weight, backbone.conv1.weight)
    x = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    before = model.backbone.bn1.running_mean.clone()
    model(x)  # train mode (the authors'): batch statistics, running averages updated
    assert not torch.equal(before, model.backbone.bn1.running_mean)
    model.backbone_bn = "eval"  # ImageNet statistics throughout
    model.train()
    before = model.backbone.bn1.running_mean.clone()
    model(x)
    assert torch.equal(before, model.backbone.bn1.running_mean)


def test_missing_resnet_weights_stop_before_training(tmp_path):
    model = resnet18_head(weights=str(tmp_path / "nowhere"))
    with pytest.raises(DataNotFoundError, match="resnet18-f37072fd.pth"):
        model(torch.zeros(1, 3, 32, 32))
    from curvopt.api import DataBundle
    from curvopt.training.build import check_model_fits_data

    # the loop's model check, one forward before the first step, stops the run with the how-to
    images, labels = torch.zeros(2, 3, 32, 32, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(DataNotFoundError, match="download.pytorch.org"):
        check_model_fits_data(
            Objective(model, "cross_entropy"), DataBundle(train=(images, labels)), "resnet18_head", "cifar10"
        )
