# The toy method (tests/toy_method): the label-frequency prior.
from xmc_steps.toymethod import spec as TOY  # noqa: E402  (its layout)


rule toymethod_train:
    """Label frequencies on the training labels; the test split's predictions."""
    input:
        Y=R(lay.INGEST) + "/Y_train.npz",
        Y_test=R(lay.INGEST) + "/Y_test.npz",
    output:
        prior=R(TOY.TOYMETHOD) + "/prior.npz",
        predictions=R(TOY.TOYMETHOD) + "/" + lay.PREDICTIONS,
        record=R(TOY.TOYMETHOD) + "/" + lay.record("train"),
    log:
        "logs/toymethod_train/{dataset}.log",
    params:
        settings=PASS("toymethod_train"),
        hash=H("toymethod_train"),
        out=R(TOY.TOYMETHOD),
    threads: 1
    shell:
        "{PY:q} -m xmc_steps.stages.toymethod --labels-train {input.Y:q} --n-test {input.Y_test:q} --out {params.out:q} "
        "--method toymethod " + STAGE_ARGS
