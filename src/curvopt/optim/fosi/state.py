"""FOSI's state: the basis state it resets, its state dict, loading it, pickling.

:class:`FOSIState` is the part of :class:`~curvopt.optim.fosi.FOSI` that holds what a run has to
keep: ``state_dict`` (torch's layout plus a ``fosi`` key; the base's *true* momentum buffers;
without V̂ just before an ESE that replaces it), ``load_state_dict`` (bit for bit; the layout
of earlier versions too) and ``__getstate__`` for ``copy.deepcopy`` and ``pickle``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from curvopt.optim.fosi.options import _flat


class FOSIState:
    """The state of :class:`~curvopt.optim.fosi.FOSI`: reset, save, load, pickle (a mixin)."""

    def __getstate__(self) -> dict[str, Any]:
        """Everything FOSI holds (``copy.deepcopy`` and ``pickle``).

        ``torch.optim.Optimizer`` pickles only ``defaults``, ``state`` and ``param_groups``; FOSI
        also needs its base, step counter, eigenbasis, velocity and loss. Pickling needs a loss
        function (and a model) that pickle can import, e.g. defined at module level.
        """
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)

    def _reset_basis_state(self) -> None:
        r = self.k + self.l
        self.V: Tensor | None = None
        self._blocks: list[Tensor] = []
        self.u: Tensor | None = None
        self.eigenvalues: Tensor | None = None  # float64, [ℓ smallest asc, k largest asc]
        self.lambda_min: float | None = None
        self.scale = 1.0
        self._vel_res: Tensor | None = None
        self._vel_res_scale = 0.0
        self._vel_res_proj = torch.zeros(r, dtype=self._dtype, device=self._device)
        self._vel_coef = torch.zeros(r, dtype=self._dtype, device=self._device)
        self._mom_proj = torch.zeros(r, dtype=self._dtype, device=self._device)  # y = V̂m (true buffer)
        self._mom_proj_fed = torch.zeros(r, dtype=self._dtype, device=self._device)  # w = V̂m′ (base's)
        self._buffers_offset = False  # the base's buffers hold m′ = m + V̂ᵀ(w − y)

    # -- (de)serialisation -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """:meth:`_fosi_state_dict` between torch.optim's state-dict pre and post hooks.

        Returns:
            The state dict (a post hook may return a replacement).
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = self._fosi_state_dict()
        # the parameters' shapes group by group, so that a load can tell a reordered optimizer
        shapes = [[list(q.shape) for q in group["params"]] for group in self.param_groups]
        state = {**state, "fosi": {**state["fosi"], "group_shapes": shapes}}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state)
            if result is not None:
                state = result
        return state

    def _fosi_state_dict(self) -> dict[str, Any]:
        """The base's state (holding the *true* momentum buffers m) and FOSI's.

        Taking it changes nothing: on the SGD fast path the base's live buffers
        m′ = m + V̂ᵀ(w − y) stay as they are; the saved base state gets corrected copies (what the
        generic path would hold), and the live m′ and w are saved beside them so that a load
        continues bit for bit.

        Returns:
            ``torch.optim``'s layout, the base's ``{"state": ..., "param_groups": ...}``, with one
            extra key ``"fosi"`` holding the step counter, ESE count, V̂, λ̂, the Newton velocity,
            the fast path's projections, the HVP mode in use and the start vector generator's
            state. Just before an ESE step that replaces V̂ (``on_ese_failure`` not ``keep``), V̂
            is left out and the Newton velocity saved materialised (``basis_dropped_before_ese``):
            a run stopped at an ESE boundary has a (k+ℓ)× smaller FOSI checkpoint. Only tensors
            and plain Python values: it loads with ``torch.load(..., weights_only=True)``.
        """
        base = self.base.state_dict()
        fed: dict[int, Tensor] = {}
        if self._buffers_offset and self.V is not None:
            z = self._mom_proj_fed - self._mom_proj
            state = dict(base["state"])
            for i, (b, p) in enumerate(zip(self._blocks, self._params)):  # packed ids: _params order
                entry = state.get(i)
                buf = entry.get("momentum_buffer") if entry is not None else None
                if buf is None or buf is not self.state.get(p, {}).get("momentum_buffer"):
                    continue
                fed[i] = buf.clone()
                true = buf.clone()
                if bool(z.any()):
                    _flat(true).addmv_(b.T, z, alpha=-1.0)  # exactly what _sync_base_buffers does
                state[i] = {**entry, "momentum_buffer": true}
            base = {**base, "state": state}
        if self._basis_replaced_next_step():  # the true buffers suffice: no fed buffers, no V̂
            return {**base, "fosi": self._state_before_ese()}
        fosi = {
            "t": self.t,
            "ese_count": self.ese_count,
            "V": self.V,
            "eigenvalues": self.eigenvalues,
            "lambda_min": self.lambda_min,
            "vel_res": self._vel_res,
            "vel_res_scale": self._vel_res_scale,
            "vel_res_proj": self._vel_res_proj,
            "vel_coef": self._vel_coef,
            "mom_proj": self._mom_proj,
            "generator": self._generator.get_state() if self._generator is not None else None,
            "hvp_mode": self.hvp_mode,
            "forward_mode_checked": self._forward_mode_checked,
        }
        if fed:
            fosi["fed_buffers"] = fed
            fosi["mom_proj_fed"] = self._mom_proj_fed.clone()
        return {**base, "fosi": fosi}

    def _basis_replaced_next_step(self) -> bool:
        """Whether the next step's ESE replaces V̂ before anything reads it.

        Then a state dict need not hold V̂ (k+ℓ parameter-sized vectors), only what the ESE
        carries over.
        """
        return self.V is not None and self.on_ese_failure != "keep" and self.ese_due()

    def _state_before_ese(self) -> dict[str, Any]:
        """FOSI's part of a state dict taken just before an ESE step, without V̂.

        The next step's ESE (:meth:`_install`) reads the old basis only to materialise the Newton
        velocity v̄ = ρ·r + V̂ᵀa and to turn the base's buffers back into the true momentum m.
        This state holds v̄ itself (one parameter-sized vector instead of k+ℓ) and the base's part
        of the state dict holds the true buffers, so a load continues bit for bit (tested), and the checkpoint of a
        run stopped at an ESE boundary is (k+ℓ)× smaller in its FOSI part.
        """
        vel = None
        if self._mom_av != 0.0:  # the same expression as _install's, in the same order
            vel = self.V.T @ self._vel_coef
            if self._vel_res is not None and self._vel_res_scale != 0.0:
                vel.add_(self._vel_res, alpha=self._vel_res_scale)
        zeros = torch.zeros(self.k + self.l, dtype=self._dtype, device=self._device)
        return {
            "t": self.t,
            "ese_count": self.ese_count,
            "V": None,
            "eigenvalues": None,
            "lambda_min": None,
            "vel_res": vel,
            "vel_res_scale": 1.0 if vel is not None else 0.0,
            "vel_res_proj": zeros,
            "vel_coef": zeros.clone(),
            "mom_proj": zeros.clone(),
            "generator": self._generator.get_state() if self._generator is not None else None,
            "hvp_mode": self.hvp_mode,
            "forward_mode_checked": self._forward_mode_checked,
            "basis_dropped_before_ese": True,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """:meth:`_fosi_load_state_dict` between torch.optim's load-state-dict pre and post hooks.

        Args:
            state_dict: As for :meth:`_fosi_load_state_dict` (a pre hook may return a replacement).
        """
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._check_group_order(state_dict)
        self._fosi_load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _check_group_order(self, state_dict: dict[str, Any]) -> None:
        """Refuse a state dict saved by a FOSI whose groups were in another order, before loading.

        ``torch.optim`` matches saved groups by position and checks only their sizes: V̂ and the
        base's buffers would land on other parameters (FOSI-GD keeps no base state to betray it).
        The saved parameter shapes, group by group (``fosi.group_shapes``; state dicts of earlier
        versions lack them and load as before), must be this optimizer's.

        Raises:
            ValueError: Naming the first group that does not fit.
        """
        saved = (state_dict.get("fosi") or {}).get("group_shapes")
        if saved is None:
            return
        here = [[list(q.shape) for q in group["params"]] for group in self.param_groups]
        for i, (a, b) in enumerate(zip(saved, here)):
            if [list(x) for x in a] != b:
                raise ValueError(
                    f"FOSI: parameter group #{i} was saved with parameter shapes {a} but has {b} here; the "
                    "state dict's groups are in another order than this optimizer's (torch.optim matches "
                    "groups by position): build the optimizer with its groups in the saved order"
                )

    def _fosi_load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the base's and FOSI's state from :meth:`state_dict`'s output.

        Tensors are moved to the parameters' device and dtype; the run continues bit for bit.

        Args:
            state_dict: A dict as returned by :meth:`state_dict` (of a FOSI over the same
                parameters and options); the layout of earlier versions,
                ``{"base": base.state_dict(), "fosi": {...}}``, is accepted too.

        Raises:
            ValueError: ``state_dict`` lacks the base optimizer's part or the ``fosi`` part.
        """
        if "fosi" in state_dict and "base" in state_dict:  # the layout before torch's
            base_sd = state_dict["base"]
        elif "fosi" in state_dict and "state" in state_dict and "param_groups" in state_dict:
            base_sd = {k: v for k, v in state_dict.items() if k != "fosi"}
        else:
            raise ValueError("not a FOSI state dict (needs 'state', 'param_groups' and 'fosi')")
        self.base.load_state_dict(base_sd)
        # torch rebuilds the group dicts on load: re-link them
        self.param_groups = self.base.param_groups
        self.state = self.base.state
        self._set_lr_refs()
        fs = state_dict["fosi"]
        if fs.get("forward_mode_checked") and self.hvp_mode == "forward_over_reverse":
            # the saved run already probed forward mode (and fell back if it failed)
            self.hvp_mode = str(fs.get("hvp_mode", self.hvp_mode))
            self._forward_mode_checked = True
        self.t, self.ese_count = int(fs["t"]), int(fs["ese_count"])
        dev, dt = self._device, self._dtype

        def to(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.to(device=dev, dtype=dt)

        self._reset_basis_state()
        V = to(fs["V"])
        if V is not None:
            lam = fs["eigenvalues"].double()
            self._install(V.contiguous(), lam, None)
            self.lambda_min = fs.get("lambda_min", self.lambda_min)
        self._vel_res = to(fs["vel_res"])
        self._vel_res_scale = float(fs["vel_res_scale"])
        self._vel_res_proj = to(fs["vel_res_proj"])
        self._vel_coef = to(fs["vel_coef"])
        self._mom_proj = to(fs["mom_proj"])
        self._mom_proj_fed = self._mom_proj.clone()  # the base state holds true buffers (w = y)
        if self._generator is not None and fs.get("generator") is not None:
            self._generator.set_state(fs["generator"])
        if fs.get("fed_buffers") and self.V is not None:  # the fast path's live buffers m′, exactly
            for i, buf in fs["fed_buffers"].items():
                live = self.state.get(self._params[int(i)], {}).get("momentum_buffer")
                if live is not None:
                    live.copy_(buf)
            self._mom_proj_fed = to(fs["mom_proj_fed"])
            self._buffers_offset = True
