"""Slurm batch jobs: options and scripts, the SLURM -> torchrun mapping, and (marked slow) submission,
failure, resume and status against a real slurmctld + slurmd started for this module."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from systems import workbook
from systems.workbook import slurm
from systems.measure.env import REPO_ROOT

# the two fastest smoke notebooks (about 7 s and 12 s on a 2-core CPU)
SMOKE_PAIR = ("02_kernel_profiling", "09_parallelism_math")

# A torchrun worker that reports the env:// variables it got and proves the rendezvous with an all-reduce.
RANK_PROBE = """
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
seen = {k: os.environ[k] for k in names}
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({**seen, "sum": total.item()}, f)
dist.destroy_process_group()
"""


@pytest.fixture(autouse=True)
def no_repository_config(monkeypatch, tmp_path):
    """A slurm.toml a developer keeps in the repository must not change what these tests expect."""
    monkeypatch.setattr(slurm, "DEFAULT_CONFIG", tmp_path / "absent.toml")


# --------------------------------------------------------------------------- node lists and rendezvous


@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("node7", ["node7"]),
    ("a[8-10],b3,c-[1-2]", ["a8", "a9", "a10", "b3", "c-1", "c-2"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert slurm.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-03", "gpu01-03]", "gpu[03-01]", "gpu[a-b]", "a,,b", "gpu[[1]]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(slurm.SlurmUsageError, match="malformed"):
        slurm.expand_nodelist(bad)


def _slurm_env(**overrides) -> dict:
    env = {"SLURM_JOB_NODELIST": "gpu[01-03,07]", "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "2",
           "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_ID": "123456"}
    return {k: v for k, v in {**env, **overrides}.items() if v is not None}


def test_rendezvous_of_a_multi_node_job():
    rdzv = slurm.rendezvous_from_slurm(_slurm_env())
    assert rdzv == slurm.Rendezvous(master_addr="gpu01", master_port=15000 + 123456 % 17000, nnodes=4,
                                    node_rank=2, nproc_per_node=8)
    assert rdzv.torchrun_args() == ["--nnodes", "4", "--node-rank", "2", "--nproc-per-node", "8",
                                    "--master-addr", "gpu01", "--master-port", str(rdzv.master_port)]
    assert rdzv.rank_env(3) == {"MASTER_ADDR": "gpu01", "MASTER_PORT": str(rdzv.master_port), "RANK": "19",
                                "WORLD_SIZE": "32", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}
    # every node agrees on the master and the port, and the ranks of all nodes are 0..31 once each
    nodes = [slurm.rendezvous_from_slurm(_slurm_env(SLURM_NODEID=str(n))) for n in range(4)]
    assert {(r.master_addr, r.master_port) for r in nodes} == {("gpu01", rdzv.master_port)}
    assert sorted(int(r.rank_env(i)["RANK"]) for r in nodes for i in range(8)) == list(range(32))


def test_rendezvous_ranks_per_node_and_port_sources():
    cpu = _slurm_env(SLURM_GPUS_ON_NODE=None, SLURM_NTASKS_PER_NODE="4(x4)")
    assert slurm.rendezvous_from_slurm(cpu).nproc_per_node == 4
    no_gpus = _slurm_env(SLURM_GPUS_ON_NODE="0", SLURM_NTASKS_PER_NODE="2")
    assert slurm.rendezvous_from_slurm(no_gpus).nproc_per_node == 2
    assert slurm.rendezvous_from_slurm(_slurm_env(), nproc_per_node=3).nproc_per_node == 3
    assert slurm.rendezvous_from_slurm(_slurm_env(MASTER_PORT="29400")).master_port == 29400
    legacy = _slurm_env(SLURM_JOB_NODELIST=None, SLURM_NODELIST="n[1-2]", SLURM_JOB_NUM_NODES=None, SLURM_NNODES="2",
                        SLURM_NODEID="1")
    assert (slurm.rendezvous_from_slurm(legacy).master_addr, slurm.rendezvous_from_slurm(legacy).node_rank) == ("n1", 1)


@pytest.mark.parametrize("overrides, message", [
    ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_JOB_NUM_NODES": "3"}, "names 4 hosts"),
    ({"SLURM_NODEID": "4"}, "outside the job's 4 nodes"),
    ({"SLURM_GPUS_ON_NODE": None, "SLURM_NTASKS_PER_NODE": None}, "SLURM_NTASKS_PER_NODE is not set"),
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID is not set"),
])
def test_rendezvous_errors_name_the_variable(overrides, message):
    with pytest.raises(slurm.SlurmUsageError, match=re.escape(message)):
        slurm.rendezvous_from_slurm(_slurm_env(**overrides))


def _check_probe(out: Path, rdzv: slurm.Rendezvous) -> None:
    """Each rank of the probe saw exactly the variables rank_env promises, and the all-reduce met."""
    world = rdzv.nnodes * rdzv.nproc_per_node
    for local in range(rdzv.nproc_per_node):
        env = rdzv.rank_env(local)
        seen = json.loads((out / f"rank{env['RANK']}.json").read_text())
        assert seen == {**env, "sum": world * (world + 1) / 2}


@pytest.mark.slow
def test_torchrun_launcher_outside_slurm(tmp_path):
    (tmp_path / "rank_probe.py").write_text(RANK_PROBE)
    env = {**os.environ, **_slurm_env(SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0",
                                      SLURM_GPUS_ON_NODE=None), "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "systems.workbook.slurm", "torchrun", "--nproc-per-node", "2", "rank_probe",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_probe(tmp_path, slurm.rendezvous_from_slurm(env, nproc_per_node=2))


# --------------------------------------------------------------------------- options, scripts, CLI


def _dry_run(capsys, *args) -> dict[str, str]:
    """The scripts `submit --dry-run` prints, by job name (also checks the exit code)."""
    assert workbook.main(["submit", "--dry-run", *args]) == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    parts = text.split(slurm.SCRIPT_SEPARATOR)[1:]
    return {part.split(":")[0]: part.split("\n", 1)[1] for part in parts}


def _sbatch_lines(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_full_profile_jobs_ask_for_their_gpus(capsys, tmp_path):
    scripts = _dry_run(capsys, "--only", "01", "07", "08", "--gpus-per-node", "4", "--run-dir", str(tmp_path / "run"))
    assert list(scripts) == ["01_benchmarking", "07_distributed", "08_sharding_fsdp", "report"]
    assert "--gpus-per-node=1" in _sbatch_lines(scripts["01_benchmarking"])
    for name in ("07_distributed", "08_sharding_fsdp"):
        lines = _sbatch_lines(scripts[name])
        assert "--gpus-per-node=4" in lines and "--cpus-per-task=32" in lines and "--mem=256G" in lines
    assert "--time=00:20:00" in _sbatch_lines(scripts["01_benchmarking"])
    assert not any("gpus" in line for line in _sbatch_lines(scripts["report"]))
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_smoke_profile_asks_for_no_gpu_and_flags_override_the_file(capsys, tmp_path):
    config = tmp_path / "cluster.toml"
    config.write_text('partition = "batch"\naccount = "cs336"\nconstraint = "h100"\ntime = 30\n'
                      'extra = ["--mail-type=FAIL"]\nsetup = ["module load cuda"]\n')
    scripts = _dry_run(capsys, "--profile", "smoke", "--only", "02", "--config", str(config), "--partition", "debug",
                       "--qos", "short", "--extra=--comment=wb")
    nb, report = _sbatch_lines(scripts["02_kernel_profiling"]), _sbatch_lines(scripts["report"])
    assert not any("gpu" in line for line in nb + report)
    assert {"--partition=debug", "--account=cs336", "--qos=short", "--constraint=h100", "--time=30",
            "--mail-type=FAIL", "--comment=wb"} <= set(nb)
    assert nb.index("--mail-type=FAIL") < nb.index("--comment=wb")  # the flag's line after the file's
    assert "--constraint=h100" not in report and "--partition=debug" in report
    assert "\nmodule load cuda\n" in scripts["02_kernel_profiling"]


def test_the_example_config_is_valid_and_shows_every_key(tmp_path):
    example = (REPO_ROOT / "slurm.example.toml").read_text()
    assert slurm.load_config(REPO_ROOT / "slurm.example.toml")
    uncommented = tmp_path / "slurm.toml"
    uncommented.write_text(re.sub(r"(?m)^# (\w+ = )", r"\1", example))
    assert set(slurm.load_config(uncommented)) == set(slurm.OPTION_KEYS)


@pytest.mark.parametrize("text, message", [
    ('partiton = "gpu"\n', "unknown key 'partiton'; known keys: partition, account"),
    ("gpus_per_node = 0\n", "gpus_per_node must be a whole number >= 1"),
    ('time = "2h"\n', "is not a Slurm time limit"),
    ('extra = "--exclusive"\n', "extra must be a list"),
    ('partition = "gpu\n', "not valid TOML"),
])
def test_bad_config_is_a_one_line_usage_error(capsys, tmp_path, text, message):
    config = tmp_path / "slurm.toml"
    config.write_text(text)
    assert workbook.main(["submit", "--dry-run", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["--time", "5h"], "--time: '5h' is not a Slurm time limit"),
    (["--mem", "lots"], "is not a Slurm memory size"),
    (["--only", "07", "--gpus-per-node", "1"], "07_distributed needs 2 GPUs"),
    (["--nodes", "2"], "belong to --bench MODULE"),
    (["--resume", "nowhere"], "holds no submission"),
    (["--resume", "nowhere", "--only", "01"], "drop --only"),
    (["--only", "98"], "no notebook matches"),
    (["--config", "missing.toml"], "does not exist"),
    (["--bench", "systems.bench.nosuch"], "--bench systems.bench.nosuch: no such module"),
    (["--bench", "nosuch.pkg.mod"], "no such module"),
])
def test_submit_usage_errors(capsys, args, message):
    assert workbook.main(["submit", "--dry-run", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_new_run_dir_refuses_an_earlier_submission(capsys, tmp_path):
    (tmp_path / slurm.MANIFEST).write_text("{}")
    assert workbook.main(["submit", "--dry-run", "--run-dir", str(tmp_path)]) == 2
    assert f"--resume {tmp_path}" in capsys.readouterr().err


def _fake_run(tmp_path: Path, names: list[str]) -> slurm.Manifest:
    """A run directory as a first attempt leaves it, jobs 11, 12, ... then the report."""
    jobs = [slurm.JobRecord(name=n, kind="notebook", job_id=str(11 + i), script="-",
                            log=str(tmp_path / "logs" / f"{n}-{11 + i}.log")) for i, n in enumerate(names)]
    jobs.append(slurm.JobRecord(name="report", kind="report", job_id="99", script="-",
                                log=str(tmp_path / "logs" / "r.log"), depends_on=[j.job_id for j in jobs]))
    manifest = slurm.Manifest(run_dir=str(tmp_path), out_dir=str(tmp_path), profile="smoke", notebooks=names,
                              parameters={"example_n": 0}, options={}, created="-",
                              attempts=[slurm.Attempt(number=1, submitted="-", parameters={}, jobs=jobs)])
    (tmp_path / "state").mkdir()
    (tmp_path / "writeup" / "executed").mkdir(parents=True)
    manifest.save()
    return manifest


def test_resume_plans_only_unfinished_notebooks(capsys, monkeypatch, tmp_path):
    _fake_run(tmp_path, ["02_kernel_profiling", "09_parallelism_math"])
    (tmp_path / "state" / "02_kernel_profiling.done").write_text("{}")
    monkeypatch.setattr(slurm, "job_states", lambda ids: {i: "COMPLETED" for i in ids})
    scripts = _dry_run(capsys, "--resume", str(tmp_path), "--time", "45")
    assert list(scripts) == ["09_parallelism_math", "report"]
    assert "--time=45" in _sbatch_lines(scripts["09_parallelism_math"])
    monkeypatch.setattr(slurm, "job_states", lambda ids: {"12": "RUNNING"})
    assert workbook.main(["submit", "--resume", str(tmp_path)]) == 1
    assert "09_parallelism_math (job 12, RUNNING)" in capsys.readouterr().err


def test_report_names_failed_and_timed_out_notebooks(monkeypatch, tmp_path):
    import nbformat

    names = ["01_a", "02_b", "03_c"]
    _fake_run(tmp_path, names)
    executed = tmp_path / "writeup" / "executed"
    for name, status in zip(names, ["completed", "failed", "running"]):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_markdown_cell(f"# {name}"), nbformat.v4.new_code_cell("x = 1")]
        nb.cells[1].metadata["papermill"] = {"status": status}
        nbformat.write(nb, executed / f"{name}.ipynb")
    (tmp_path / "state" / "01_a.done").write_text(json.dumps({"seconds": 7.2}))
    (tmp_path / "state" / "02_b.failed").write_text(json.dumps({"error": "02_b.py: cell 1 (execution count 1) raised "
                                                                          "ValueError: n must be >= 1"}))
    monkeypatch.setattr(slurm, "job_states", lambda ids: {"11": "COMPLETED", "12": "FAILED", "13": "TIMEOUT"})
    html = slurm.write_report(tmp_path).read_text()
    assert "Slurm run: 1 of 3 notebooks finished" in html
    assert "<b>02_b</b>: FAILED: 02_b.py: cell 1 (execution count 1) raised ValueError" in html
    assert "<b>03_c</b>: NOT FINISHED: ended without a result (TIMEOUT); cell 1 was running when it stopped" in html
    assert 'href="../logs/03_c-13.log"' in html
    assert html.index('id="slurm-run"') < html.index('id="01_a"')  # the summary heads the report


# --------------------------------------------------------------------------- a real scheduler


SLURM_PROGRAMS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")


@dataclass
class Cluster:
    conf: Path
    env: dict
    node: str
    partition: str
    settings: Path  # an empty slurm.toml, so that the repository's own (if any) is not read

    def run(self, *cmd, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(c) for c in cmd], env=self.env, capture_output=True, text=True, timeout=timeout,
                              cwd=REPO_ROOT)
        assert not check or proc.returncode == 0, f"{cmd}: {proc.stdout}{proc.stderr}"
        return proc

    def workbook(self, *args, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(sys.executable, "-m", "systems.workbook", *args, check=check)

    def job(self, job_id: str) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_ids, *, timeout: float) -> dict[str, dict]:
        end = time.monotonic() + timeout
        while True:
            jobs = {j: self.job(j) for j in job_ids}
            if all(job["JobState"] not in slurm.ACTIVE_STATES for job in jobs.values()):
                return jobs
            assert time.monotonic() < end, f"jobs still in the queue after {timeout} s: {jobs}"
            time.sleep(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """slurmctld + slurmd for this module on this machine (its real cores and memory), no munge."""
    missing = [p for p in SLURM_PROGRAMS if shutil.which(p) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not on PATH): `apt-get install slurm-wlm` "
                    "(Debian) provides slurmctld, slurmd and the client commands these tests need")
    if os.geteuid() != 0:
        pytest.skip("the scheduler tests start slurmd, which must run as root to launch jobs")
    tmp = tmp_path_factory.mktemp("slurm")
    hardware = dict(re.findall(r"(\w+)=(\S+)", subprocess.run(["slurmd", "-C"], capture_output=True, text=True).stdout))
    node = socket.gethostname().split(".")[0]
    for sub in ("state", "spool", "log"):
        (tmp / sub).mkdir()
    conf = tmp / "slurm.conf"
    # auth/none: this Slurm (22.05) still ships it, so no munge key or munged is needed; no cgroups
    # here, so processes are tracked through /proc and tasks are not bound
    conf.write_text(f"""ClusterName=workbook
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/log/slurmctld.log
SlurmdLogFile={tmp}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
MinJobAge=3600
NodeName={node} NodeAddr=127.0.0.1 CPUs={hardware['CPUs']} RealMemory={hardware['RealMemory']} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(conf))  # for slurm.job_states called in this process
        (tmp / "empty.toml").write_text("")
        cluster = Cluster(conf=conf, env=env, node=node, partition="debug", settings=tmp / "empty.toml")
        try:
            for cmd in (["slurmctld", "-D", "-c", "-f", conf], ["slurmd", "-D", "-N", node, "-f", conf]):
                log = open(tmp / "log" / f"{cmd[0]}.out", "w")
                daemons.append(subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT))
                log.close()
            end = time.monotonic() + 30
            while cluster.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout.strip() != "idle":
                if time.monotonic() > end:
                    logs = "".join((tmp / "log" / f).read_text()[-2000:] for f in ("slurmctld.out", "slurmd.out"))
                    pytest.fail(f"the test cluster's node did not become idle within 30 s:\n{logs}")
                time.sleep(0.5)
            yield cluster
        finally:
            if daemons and daemons[0].poll() is None:
                queued = cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
                if queued:  # a failed test can leave jobs; their slurmstepd must end before slurmd does
                    cluster.run("scancel", *queued, check=False)
                    end = time.monotonic() + 30
                    while cluster.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < end:
                        time.sleep(0.5)
            for proc in reversed(daemons):
                _stop(proc)


def _smoke_submit(cluster: Cluster, run: Path, *args) -> slurm.Manifest:
    # one core each, so that both notebooks run at once on a 2-core machine
    cluster.workbook("submit", "--profile", "smoke", "--only", *SMOKE_PAIR, "--cpus-per-task", "1", "--mem", "3G",
                     "--config", cluster.settings, "--run-dir", run, *args)
    return slurm.read_manifest(run)


def _jobs(manifest: slurm.Manifest) -> dict[str, str]:
    return {j.name: j.job_id for j in manifest.attempts[-1].jobs}


@pytest.mark.slow
def test_scontrol_agrees_with_expand_nodelist(cluster):
    nodelist = "gpu[01-03,07],cpu-a[8-10],x,r[1-2]n[01-02]"
    assert cluster.run("scontrol", "show", "hostnames", nodelist).stdout.split() == slurm.expand_nodelist(nodelist)


@pytest.mark.slow
def test_dry_run_scripts_pass_sbatch_test_only(cluster, tmp_path):
    text = cluster.workbook("submit", "--dry-run", "--profile", "smoke", "--only", *SMOKE_PAIR, "--partition",
                            cluster.partition, "--time", "00:05:00", "--mem", "2G", "--extra=--comment=dry",
                            "--config", cluster.settings, "--run-dir", tmp_path / "run").stdout
    scripts = [part.split("\n", 1)[1] for part in text.split(slurm.SCRIPT_SEPARATOR)[1:]]
    assert len(scripts) == 3 and not (tmp_path / "run").exists()
    for i, script in enumerate(scripts):
        path = tmp_path / f"job{i}.sbatch"
        path.write_text(script)
        proc = cluster.run("sbatch", "--test-only", path, check=False)
        assert proc.returncode == 0 and "to start at" in proc.stderr, proc.stderr
    # --test-only does judge the request: this node has no GPU for the full profile
    full = cluster.workbook("submit", "--dry-run", "--only", "01", "--config", cluster.settings,
                            "--run-dir", tmp_path / "full").stdout
    (tmp_path / "full.sbatch").write_text(full.split(slurm.SCRIPT_SEPARATOR)[1].split("\n", 1)[1])
    assert cluster.run("sbatch", "--test-only", tmp_path / "full.sbatch", check=False).returncode != 0


@pytest.mark.slow
def test_two_smoke_notebooks_then_the_report(cluster, tmp_path):
    run = tmp_path / "run"
    jobs = _jobs(_smoke_submit(cluster, run))
    assert set(jobs) == {*SMOKE_PAIR, "report"}
    report = cluster.job(jobs["report"])  # queried while the notebooks run (each takes several seconds)
    waits_on = re.findall(r"afterany:(\d+)\(unfulfilled\)", report["Dependency"])
    assert sorted(waits_on) == sorted(jobs[n] for n in SMOKE_PAIR) and report["Reason"] == "Dependency"
    states = cluster.wait(jobs.values(), timeout=150)
    assert {name: states[job]["JobState"] for name, job in jobs.items()} == dict.fromkeys(jobs, "COMPLETED")
    # the report job started only after both notebook jobs had ended (afterany)
    assert states[jobs["report"]]["StartTime"] >= max(states[jobs[n]]["EndTime"] for n in SMOKE_PAIR)
    for name in SMOKE_PAIR:
        cells = json.loads((run / "writeup" / "executed" / f"{name}.ipynb").read_text())["cells"]
        assert {c["metadata"]["papermill"]["status"] for c in cells} == {"completed"}
        assert (run / "state" / f"{name}.done").exists()
    assert list((run / "figures").glob("09_parallelism_math_*.png"))  # outputs land in the run dir
    html = (run / "writeup" / "report.html").read_text()
    assert "Slurm run: 2 of 2 notebooks finished" in html and "FAILED" not in html
    assert (run / "state" / "report.done").exists()
    status = cluster.workbook("status", run).stdout
    for name, job in jobs.items():
        line = next(line for line in status.splitlines() if line.split()[0] == name)
        assert f"job {job}" in line and "COMPLETED" in line and "finished" in line
        assert (run / "logs" / f"{name}-{job}.log").exists()


@pytest.mark.slow
def test_a_failed_notebook_is_reported_and_resume_reruns_only_it(cluster, tmp_path):
    run = tmp_path / "run"
    first = _jobs(_smoke_submit(cluster, run, "-p", "example_n", "0"))  # notebook 09 raises on 0 devices
    states = cluster.wait(first.values(), timeout=150)
    assert {n: states[j]["JobState"] for n, j in first.items()} == {
        "02_kernel_profiling": "COMPLETED", "09_parallelism_math": "FAILED", "report": "COMPLETED"}
    failure = json.loads((run / "state" / "09_parallelism_math.failed").read_text())["error"]
    assert re.match(r"09_parallelism_math\.py: cell \d+ \(execution count \d+\) raised ValueError", failure)
    html = (run / "writeup" / "report.html").read_text()
    assert "Slurm run: 1 of 2 notebooks finished" in html and f"FAILED: {failure.split(':')[0]}: cell" in html
    assert "FAILED" in (run / "logs" / f"09_parallelism_math-{first['09_parallelism_math']}.log").read_text()
    assert any(line.split()[:1] == ["09_parallelism_math"] and "FAILED" in line
               for line in cluster.workbook("status", run).stdout.splitlines())
    kept = (run / "writeup" / "executed" / "02_kernel_profiling.ipynb").stat().st_mtime_ns

    cluster.workbook("submit", "--resume", run, "-p", "example_n", "8")
    manifest = slurm.read_manifest(run)
    second = _jobs(manifest)
    assert set(second) == {"09_parallelism_math", "report"} and manifest.attempts[-1].parameters["example_n"] == 8
    states = cluster.wait(second.values(), timeout=150)
    assert {states[j]["JobState"] for j in second.values()} == {"COMPLETED"}
    assert (run / "writeup" / "executed" / "02_kernel_profiling.ipynb").stat().st_mtime_ns == kept
    assert len(list((run / "logs").glob("02_kernel_profiling-*.log"))) == 1
    assert not (run / "state" / "09_parallelism_math.failed").exists()
    assert "Slurm run: 2 of 2 notebooks finished" in (run / "writeup" / "report.html").read_text()
    again = cluster.workbook("submit", "--resume", run).stdout
    assert "nothing to submit" in again and len(slurm.read_manifest(run).attempts) == 2


@pytest.mark.slow
def test_bench_job_starts_torchrun_through_srun(cluster, tmp_path):
    (tmp_path / "rank_probe.py").write_text(RANK_PROBE)
    cluster.env["PYTHONPATH"] = str(tmp_path)  # sbatch passes the environment on to the job and srun
    try:
        run = tmp_path / "run"
        cluster.workbook("submit", "--bench", "rank_probe", "--profile", "smoke", "--nodes", "1", "--mem", "3G",
                         "--config", cluster.settings, "--run-dir", run,
                         "--", ".")  # the job works in the run dir, so "." lands there
    finally:
        del cluster.env["PYTHONPATH"]
    job = _jobs(slurm.read_manifest(run))["bench"]
    assert cluster.wait([job], timeout=90)[job]["JobState"] == "COMPLETED"
    rdzv = slurm.Rendezvous(master_addr=cluster.node, master_port=slurm.port_for_job(int(job)), nnodes=1, node_rank=0,
                            nproc_per_node=2)
    _check_probe(run, rdzv)
    assert (run / "state" / "bench.done").exists()
    assert "--nproc-per-node 2" in (run / "logs" / f"bench-{job}.log").read_text()
