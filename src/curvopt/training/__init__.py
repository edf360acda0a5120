"""The training loop, its run records and the Hydra glue (:mod:`curvopt.training.build`).

Importing the package registers the structured-config schemas of ``conf/``
(:mod:`curvopt.training.schema`).
"""

from curvopt.training.schema import register_schemas

register_schemas()
