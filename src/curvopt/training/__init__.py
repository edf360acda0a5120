"""The training loop, its run records and the Hydra glue (:mod:`curvopt.training.build`).

Importing the package has no side effect: an entrypoint that composes ``conf/`` registers the
structured-config schemas itself (:func:`curvopt.training.schema.register_schemas`, idempotent), as
``src/train.py`` does before Hydra composes.
"""
