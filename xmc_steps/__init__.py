"""xmc_steps: the stages of the XMC experiment pipeline, one module per stage.

Every stage module exposes importable functions and a ``main(argv)`` CLI
(``python -m xmc_steps.<stage> --help``).  Stages talk only through files; the
file formats live in :mod:`xmc_steps.io`.
"""

__version__ = "0.1.0"
