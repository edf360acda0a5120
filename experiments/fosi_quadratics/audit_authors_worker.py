"""The jax side of ``audit_authors.py``: runs the authors' Figures 7-8 script logic on given cells.

Not imported by the repository: ``audit_authors.py`` starts it with a separate Python that has jax
(the authors pinned jax 0.4.x; our venv has none), as

    <jax python> audit_authors_worker.py <authors_src> <cells.json> <out.json>

It uses only the standard library, numpy, scipy, jax and the authors' checkout. For each (b, ζ) it
repeats the body of the loop of ``run_grid_kappa_zeta`` in
``experiments/quadratic/quadratic_jax_kappa_zeta.py``: ``numpy.random.seed(1234)``, their
``prepare_hessian``, ``get_x_initial``, their ESE (``fosi.get_ese_fn``, k = 10, float64) at θ₀,
and their ``optimize`` with ``adam_update`` / ``fosi_adam_update`` at η = 0.05, β₁ = 0.9, β₂ =
0.999, 200 iterations, and writes θ₀ and f(θ_t) for t = 0..200.

The authors' ``fosi/__init__.py`` also imports their PyTorch port and optimizer (torch, functorch,
torchopt, optax); the script needs only ``get_ese_fn``, so this worker registers ``fosi`` and
``fosi.jax_optim`` as bare packages over the checkout and imports the ESE module alone: no file of
the checkout is changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import platform
import sys
import time
import types
from pathlib import Path

AUTHORS_FILES = (
    "experiments/quadratic/quadratic_jax_kappa_zeta.py",
    "experiments/quadratic/quadratic_test_utils.py",
    "fosi/jax_optim/extreme_spectrum_estimation.py",
    "fosi/jax_optim/lanczos_algorithm.py",
)


def _bare_package(name: str, path: Path) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    sys.modules[name] = mod


def main(src: Path, cells_path: Path, out_path: Path) -> None:
    sys.path.insert(0, str(src))
    _bare_package("fosi", src / "fosi")
    _bare_package("fosi.jax_optim", src / "fosi" / "jax_optim")
    with contextlib.redirect_stdout(sys.stderr):  # the authors' code prints as it goes
        ese_mod = importlib.import_module("fosi.jax_optim.extreme_spectrum_estimation")
        sys.modules["fosi"].get_ese_fn = ese_mod.get_ese_fn
        script = importlib.import_module("experiments.quadratic.quadratic_jax_kappa_zeta")
    import jax
    import jaxlib
    import numpy
    import scipy

    utils = importlib.import_module("experiments.quadratic.quadratic_test_utils")
    # the grid exactly as run_grid_kappa_zeta builds it (kappa is b)
    kappa_arr = numpy.concatenate((numpy.arange(1.10, 1.14, 0.01), numpy.arange(1.14, 1.17, 0.002)))
    cells = json.loads(cells_path.read_text())
    results = []
    for b, zeta in cells:
        (kappa,) = [k for k in kappa_arr if round(float(k), 3) == round(float(b), 3)]
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            numpy.random.seed(1234)
            hessian, _, eigenvectors = script.prepare_hessian(kappa, int(zeta))
            objective_fn = lambda x, batch=None, h=hessian: utils.objective(x, h, batch)  # noqa: E731
            x_initial = utils.get_x_initial(objective_fn, eigenvectors)
            ese_fn = script.get_ese_fn(objective_fn, 10, [None], l_smallest=0, return_precision="64")
            k_eigenvals, k_eigenvecs = ese_fn(x_initial)

            def fosi_adam(x, g, m, v, t, eta, beta1, beta2, mn, lam=k_eigenvals, vec=k_eigenvecs):
                return utils.fosi_adam_update(x, g, m, v, t, eta, beta1, beta2, mn, lam, vec)

            curves = {}
            for name, update in (("adam", utils.adam_update), ("fosi_adam", fosi_adam)):
                scores, _ = utils.optimize(objective_fn, x_initial, 200, 0.05, 0.9, 0.999, update)
                curves[name] = [float(s) for s in jax.device_get(scores)]
        results.append(
            {
                "b": round(float(kappa), 3),
                "zeta": int(zeta),
                "kappa_exact": float(kappa),
                "lambda_hat": [float(x) for x in jax.device_get(k_eigenvals)],
                "theta0": [float(x) for x in jax.device_get(x_initial)],
                "f": curves,
                "seconds": time.perf_counter() - t0,
            }
        )
        print(f"authors b={float(kappa):.3f} zeta={int(zeta)}: "
              f"Adam {curves['adam'][-1]:.6g} FOSI-Adam {curves['fosi_adam'][-1]:.6g}", flush=True)  # fmt: skip
    out = {
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "numpy": numpy.__version__,
            "scipy": scipy.__version__,
            "jax_enable_x64": bool(jax.config.jax_enable_x64),
            "backend": jax.default_backend(),
        },
        "authors_files_sha256": {
            f: hashlib.sha256((src / f).read_bytes()).hexdigest() for f in AUTHORS_FILES
        },
        "cells": results,
    }
    out_path.write_text(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
