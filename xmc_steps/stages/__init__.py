"""The stages: every module here is a command-line entry point run by a Snakemake rule (or by a
user: ``python -m xmc_steps.stages.predict``).  A stage parses its arguments, runs inside the stage
harness (``xmc_steps.stage.stage_run``: log, timings, peak memory, record, MLflow, cleanup on
failure) and calls library code, which lives outside this folder.

Two rules, checked by ``tests/test_structure.py``: every module with a ``main()`` lives here, and no
stage imports another stage (nor does library code import a stage).
"""
