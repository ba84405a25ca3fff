"""Reliability (issue 37): the default profile applies, stages die with their starter, a rerun removes
a killed run's temporaries and marks its MLflow run KILLED, artifacts get the umask's modes, native
output stays off stdout."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from conftest import ROOT
from xmc_steps import io, proc
from xmc_steps.stage import stage_run

# --------------------------------------------------------------------------- 1. the default profile


def _resolved(argv: list[str]):
    from snakemake.cli import parse_args

    return parse_args(argv)[1]


def test_plain_snakemake_loads_the_default_workflow_profile(tmp_path, monkeypatch):
    """What Snakemake itself resolves (its own argument parser): with no --workflow-profile, in the
    checkout and with --snakefile from elsewhere, the settings of workflow/profiles/default apply."""
    profile = yaml.safe_load((ROOT / "workflow" / "profiles" / "default" / "config.yaml").read_text())
    assert profile["rerun-incomplete"] is True and profile["show-failed-logs"] is True
    monkeypatch.chdir(ROOT)
    a = _resolved(["-n"])
    assert (a.rerun_incomplete, a.show_failed_logs, a.printshellcmds, a.latency_wait) == (
        True, True, True, profile["latency-wait"])
    monkeypatch.chdir(tmp_path)
    a = _resolved(["-n", "--snakefile", str(ROOT / "Snakefile")])
    assert a.rerun_incomplete and a.show_failed_logs
    off = _resolved(["-n", "--snakefile", str(ROOT / "Snakefile"), "--workflow-profile", "none"])
    assert not off.rerun_incomplete and not off.show_failed_logs          # Snakemake's own defaults differ
    # one copy of each profile: the lookup path is a link to workflow/profiles
    assert (ROOT / "profiles").is_symlink() and (ROOT / "profiles").resolve() == (ROOT / "workflow" / "profiles")


def test_the_slurm_profile_still_replaces_it(monkeypatch):
    monkeypatch.chdir(ROOT)
    a = _resolved(["-n", "--workflow-profile", "workflow/profiles/slurm"])
    assert a.executor == "slurm" and a.latency_wait == 60 and a.jobs == 50


# --------------------------------------------------------------------------- 2. orphans

SLEEPER = """
import argparse, os, sys, time
sys.path.insert(0, {root!r})
from xmc_steps.stage import add_common_args, cli_main, stage_run

def main(argv=None):
    p = add_common_args(argparse.ArgumentParser())
    p.add_argument("--pidfile")
    args = p.parse_args(argv)
    with stage_run("sleeper", args):
        with open(args.pidfile + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(args.pidfile + ".tmp", args.pidfile)
        time.sleep(300)

raise SystemExit(cli_main(main))
"""

STARTER = """
import subprocess, sys, time
subprocess.Popen(sys.argv[1:])
time.sleep(300)
"""


def _gone(pid: int) -> bool:
    return not proc.pid_alive(pid)


def _wait_for(cond, limit: float) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.mark.parametrize("through", ["bash", "direct"])
def test_a_stage_ends_when_the_process_that_started_it_is_killed(tmp_path, through):
    """starter (Snakemake's stand-in) -> [bash -c, which waits: a redirection keeps it from exec'ing]
    -> stage.  ``direct``: the stage's parent is the starter itself (bash exec'd it), and the
    watchdog is slowed down so that the parent-death signal is what ends it."""
    sleeper, starter, pidfile = tmp_path / "sleeper.py", tmp_path / "starter.py", tmp_path / "stage.pid"
    sleeper.write_text(SLEEPER.format(root=str(ROOT)))
    starter.write_text(STARTER)
    stage_cmd = [sys.executable, str(sleeper), "--pidfile", str(pidfile), "--no-tracking"]
    if through == "bash":
        cmd = ["bash", "-c", " ".join(stage_cmd) + f" 2> {tmp_path / 'stage.err'}; echo after"]
    else:
        cmd = stage_cmd
    env = dict(os.environ, XMC_TRACKING="0", XMC_ORPHAN_POLL_S="0.1" if through == "bash" else "3600")
    s = subprocess.Popen([sys.executable, str(starter), *cmd], env=env, start_new_session=True)
    stage_pid = None
    try:
        assert _wait_for(pidfile.exists, 600), "the stage did not start"
        stage_pid = int(pidfile.read_text())
        time.sleep(1.0)
        assert proc.pid_alive(stage_pid), "the stage ended while its starter was alive"
        s.send_signal(signal.SIGKILL)
        s.wait(60)
        assert _wait_for(lambda: _gone(stage_pid), 120), "the stage outlived the process that started it"
        if through == "bash":
            assert "the process that started this stage died" in (tmp_path / "stage.err").read_text()
    finally:
        if s.poll() is None:
            s.kill()
        if stage_pid and not _gone(stage_pid):
            os.kill(stage_pid, signal.SIGKILL)


MARKING_STARTER = """
import subprocess, sys, time
sys.path.insert(0, {root!r})
from xmc_steps import proc
proc.mark_workflow()
print(subprocess.Popen(sys.argv[1:]).pid, flush=True)
time.sleep(300)
"""


def test_a_stage_whose_snakemake_died_while_it_started_does_no_work(tmp_path):
    """Issue 54.2: Snakemake (a stand-in that marks itself as common.smk does) is killed before its stage's
    interpreter runs: by then the stage's shell is re-parented and the ancestor watch sees nothing to watch.
    The stage stops before any work (no pidfile, the reason in its stderr), deterministically: the shell
    waits for a file the test writes only once the starter is gone."""
    sleeper, starter, pidfile, go = tmp_path / "sleeper.py", tmp_path / "starter.py", tmp_path / "stage.pid", tmp_path / "go"
    sleeper.write_text(SLEEPER.format(root=str(ROOT)))
    starter.write_text(MARKING_STARTER.format(root=str(ROOT)))
    err = tmp_path / "stage.err"
    line = (f"while [ ! -e {go} ]; do sleep 0.05; done; {sys.executable} {sleeper} --pidfile {pidfile} --no-tracking "
            f"2> {err}; echo $? > {tmp_path / 'rc'}")
    env = dict(os.environ, XMC_TRACKING="0")
    s = subprocess.Popen([sys.executable, str(starter), "bash", "-c", line], env=env, stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        shell = int(s.stdout.readline())
        s.send_signal(signal.SIGKILL)
        s.wait(60)
        go.write_text("")
        assert _wait_for(lambda: (tmp_path / "rc").exists(), 600), "the stage did not end"
        assert not pidfile.exists(), "the stage did its work after the Snakemake that started it was gone"
        assert "has ended; stopping before any work" in err.read_text()
        assert (tmp_path / "rc").read_text().strip() == str(128 + signal.SIGTERM)
    finally:
        if s.poll() is None:
            s.kill()
        if proc.pid_alive(shell):
            os.kill(shell, signal.SIGKILL)


def test_a_live_snakemake_lets_its_stages_run_and_another_hosts_is_not_judged(monkeypatch):
    monkeypatch.setenv(proc.WORKFLOW_ENV, "")            # mark_workflow sets it: restored afterwards
    assert proc.workflow_gone(proc.mark_workflow()) is None
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert "has ended" in proc.workflow_gone(f"{proc.owner_tag(dead.pid)} 0")
    assert proc.workflow_gone(f"p{dead.pid}-00000000 0") is None       # another host's pid
    assert proc.workflow_gone("") is None and proc.workflow_gone("garbage") is None


def _chain_under(shell_argv: list[str], stdin: str | None = None) -> list[int]:
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from xmc_steps import proc; print([p for p, _ in proc.starter_chain()])"
    line = f'"{sys.executable}" -c "{code}" 2>&1; true'
    r = subprocess.run(shell_argv + ([] if stdin else [line]), input=line if stdin else None, capture_output=True, text=True)
    return eval(r.stdout.strip().splitlines()[-1])


def test_the_starter_chain_climbs_through_command_wrappers_only():
    """Under ``bash -c`` (bash waits, since a command follows) a stage watches bash and the process above
    it (this test's), and no further; typed into a shell reading commands (a terminal), it watches
    nothing (the terminal's SIGHUP and nohup decide); a broken link is named."""
    assert _chain_under(["bash", "-c"])[1:] == [os.getpid()]
    assert _chain_under(["env", "bash", "-c"])[1:] == [os.getpid()]
    assert _chain_under(["bash"], stdin="yes") == []
    import psutil

    me, parent = os.getpid(), psutil.Process().parent()
    if parent is not None and parent.pid > 1:
        assert proc.chain_broken(me, [(parent.pid, parent.create_time())]) is None
        assert "is gone" in proc.chain_broken(me, [(parent.pid, parent.create_time() + 1.0)])   # pid reused
        # a chain naming process 1 as the parent: re-parented (where pytest's parent is process 1 itself, under
        # `setsid nohup`, that link holds and only its start time differs)
        assert "re-parented" in proc.chain_broken(me, [(1, 0.0)])


# --------------------------------------------------------------------------- 3. temporaries after a kill

KILLED_WRITER = """
import os, sys
sys.path.insert(0, {root!r})
from xmc_steps import io
with io.atomic_path({file!r}) as tmp:
    tmp.write_text("half")
    with io.atomic_dir({folder!r}) as d:
        (d / "weights.bin").write_bytes(b"half")
        os.kill(os.getpid(), 9)
"""


def test_a_rerun_removes_the_temporaries_a_killed_run_left_and_no_live_ones(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    f, folder = out / "table.parquet", out / "model"
    r = subprocess.run([sys.executable, "-c", KILLED_WRITER.format(root=str(ROOT), file=str(f), folder=str(folder))])
    assert r.returncode == -9
    left = sorted(p.name for p in out.iterdir())
    assert len(left) == 2 and all(".tmp" in n for n in left), left      # what a kill leaves behind
    foreign = out / ".table.parquet.p1234-00000000.abc123.tmp.parquet"   # another host's writer: kept
    foreign.write_text("x")
    unrelated = out / ".table.parquet.swp"                               # not ours: kept
    unrelated.write_text("x")
    with io.atomic_path(f) as live:                                      # a live writer's: kept
        live.write_text("in progress")
        args = argparse.Namespace(log=None, record=None, params="{}", no_tracking=True)
        with stage_run("rerun", args, outputs=[str(f), str(folder)]):
            pass
        assert live.exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([foreign.name, unrelated.name, "table.parquet"])


def test_the_tfidf_spill_folder_is_a_temporary_that_the_rerun_removes(tmp_path):
    """Issue 54: a killed TF-IDF fit left an empty mode-0700 ``tfidf-spill-*`` folder that nothing removed.
    The spill folder is now named as the atomic writers' temporaries beside ``<out>/tfidf-spill``, which
    the tfidf stage declares, so its rerun removes a dead writer's; a finished fit leaves nothing."""
    from xmc_steps import tfidf

    out = tmp_path / "tfidf"
    tfidf.fit_streaming([["alpha beta gamma", "alpha beta", "beta gamma"]], {"min_df": 1}, spill_dir=out)
    assert list(out.iterdir()) == []
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = out / f".{tfidf.SPILL}.{proc.owner_tag(dead.pid)}.k3j9x2q_.tmp"
    left.mkdir(mode=0o700)
    args = argparse.Namespace(log=None, record=None, params="{}", no_tracking=True)
    with stage_run("tfidf", args, outputs=[str(out / "X_train.npz"), str(out / tfidf.SPILL)]):
        pass
    assert not left.exists()


def test_temporary_names_carry_their_writer(tmp_path):
    with io.atomic_path(tmp_path / "a.npz") as tmp:
        assert tmp.name.startswith(f".a.npz.{proc.owner_tag()}.") and tmp.name.endswith(".tmp.npz")
        found = io.stale_temporaries(tmp_path / "a.npz")
        assert found == [(tmp, os.getpid(), True)]
        assert io.remove_stale_temporaries([tmp_path / "a.npz"]) == [] and tmp.exists()


# --------------------------------------------------------------------------- 4. MLflow runs left RUNNING


def test_a_run_left_running_by_a_killed_job_is_marked_killed_by_the_next(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from xmc_steps import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("XMC_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("XMC_GIT_COMMIT", "feedbeef")
    rec = {"stage": "tfidf", "rule": "tfidf", "dataset": "toy", "method": "", "config_hash": "h", "wall_s": 1.0,
           "params": {}, "metrics": {"vocab": 3}, "outputs": {"vocab": "results/toy/tfidf/vocab.parquet"}}

    def killed_half_way(*a, **k):                       # the job dies after creating its run
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(tracking, "_chunks", killed_half_way)
        for _ in range(3):
            with pytest.raises(KeyboardInterrupt):
                tracking.log_stage(rec)
    client = MlflowClient(tracking.tracking_uri())
    exp = client.get_experiment_by_name("toy")
    running = client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING' and tags.`xmc.run_type` = 'stage'")
    assert len(running) == 3 and all(r.data.tags["xmc.rule"] == "tfidf" for r in running)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        other = dict(rec, outputs={"vocab": "results/toy/other/vocab.parquet"})
        r_dead, r_live, r_other = (r.info.run_id for r in running)
        client.set_tag(r_dead, "xmc.pid", str(dead.pid))
        client.set_tag(r_live, "xmc.pid", str(live.pid))
        client.set_tag(r_other, "xmc.pid", str(dead.pid))
        client.set_tag(r_other, "xmc.outputs_key", tracking.outputs_key(other["outputs"]))   # another job of the rule
        new = tracking.log_stage(rec)
        status = {rid: client.get_run(rid).info.status for rid in (r_dead, r_live, r_other, new)}
        assert status == {r_dead: "KILLED", r_live: "RUNNING", r_other: "RUNNING", new: "FINISHED"}
        assert str(dead.pid) in client.get_run(r_dead).data.tags["xmc.killed_note"]
        assert client.get_run(new).data.tags["xmc.pid"] == str(os.getpid())
    finally:
        live.kill()
        live.wait()


# --------------------------------------------------------------------------- 7. modes


@pytest.mark.parametrize("umask,file_mode,dir_mode", [("022", 0o644, 0o755), ("077", 0o600, 0o700), ("002", 0o664, 0o775)])
def test_artifacts_get_the_modes_the_umask_gives(tmp_path, umask, file_mode, dir_mode):
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from xmc_steps import io
        io.write_json({str(tmp_path / "a.json")!r}, {{"x": 1}})
        with io.atomic_dir({str(tmp_path / "model")!r}) as d:
            (d / "w.bin").write_bytes(b"1")
    """)
    r = subprocess.run(["bash", "-c", f'umask {umask} && exec "$0" -c "$1"', sys.executable, code],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == file_mode
    assert (tmp_path / "model").stat().st_mode & 0o777 == dir_mode
    assert (tmp_path / "model" / "w.bin").stat().st_mode & 0o777 == file_mode


# --------------------------------------------------------------------------- 5. native output off stdout


def test_native_output_goes_to_stderr_inside_the_block(tmp_path):
    """omikuji's Rust logger writes to file descriptor 1; inside stdout_to_stderr it lands on stderr,
    and what Python prints before and after stays on stdout, in order."""
    pytest.importorskip("omikuji")
    data = tmp_path / "train.txt"
    data.write_text("4 3 2\n0 0:1\n1 1:1\n0 0:1 2:1\n1 1:1 2:1\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import omikuji
        from xmc_steps.proc import stdout_to_stderr
        print("before")
        with stdout_to_stderr():
            m = omikuji.Model.train_on_data({str(data)!r}, omikuji.Model.default_hyper_param(), n_threads=1)
            print("python inside")
        print("after", m.predict([(0, 1.0)], beam_size=2, top_k=1)[0][0])
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "before\nafter 0\n"
    assert "omikuji" in r.stderr and "python inside" in r.stderr
