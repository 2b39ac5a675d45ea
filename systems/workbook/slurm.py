"""Run the workbook as Slurm batch jobs: sbatch scripts, submission, resume, status, and the
SLURM -> torchrun rendezvous of multi-node benchmarks.

    python -m systems.workbook submit [--only 01 03] [--profile full|smoke] [-p NAME VALUE] [--config FILE]
           [--partition P] [--account A] [--qos Q] [--time T] [--gpus-per-node G] [--constraint C]
           [--cpus-per-task N] [--mem M] [--extra=--SBATCH-OPTION] [--run-dir DIR] [--out-dir DIR] [--dry-run]
    python -m systems.workbook submit --resume RUN_DIR [-p NAME VALUE] [--time T] ...
    python -m systems.workbook submit --bench MODULE [--nodes N] [--nproc-per-node R] ... -- MODULE_ARGS
    python -m systems.workbook status [RUN_DIR]

A submission is one run directory (default build/slurm/<timestamp>/): manifest.json, the job
scripts (jobs/<attempt>/), the logs (logs/NAME-<jobid>.log), one marker per notebook
(state/NAME.done on success, state/NAME.failed with the failing cell otherwise; state/report.done
once the report is written) and, unless --out-dir names another place, the notebooks' outputs
(writeup/, figures/, results/).

The job scripts call back into this module:

    python -m systems.workbook.slurm notebook --run-dir RUN NAME    # one notebook, then its marker
    python -m systems.workbook.slurm report --run-dir RUN           # writeup/report.html with what finished
    python -m systems.workbook.slurm torchrun [--nproc-per-node R] MODULE ARGS   # one per node, under srun
"""

from __future__ import annotations

import argparse
import datetime as _dt
import html
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Mapping

from systems.measure.env import REPO_ROOT, git_commit
from systems.workbook import html as report_html
from systems.workbook import notebooks as runner

COMMANDS = ("submit", "status")
CONFIG_NAME = "slurm.toml"
DEFAULT_CONFIG = REPO_ROOT / CONFIG_NAME
DEFAULT_ROOT = REPO_ROOT / "build" / "slurm"
MANIFEST = "manifest.json"
PROFILES = ("full", "smoke")
SCRIPT_SEPARATOR = "# ===== "

# Full-profile wall-clock limits in minutes: about three times each notebook's papermill duration
# in the committed run (writeup/executed) or more, at least 10, because a first run on a cluster
# node also fills the Triton and torch.compile caches.
FULL_MINUTES = {"01_benchmarking": 20, "05_attention_compile": 25, "06_flash_attention": 20,
                "07_distributed": 15}
FULL_MINUTES_DEFAULT = 10
FULL_CPUS_PER_GPU = 8
FULL_MEM_GB_PER_GPU = 64
# A smoke notebook takes under 60 s on a 2-core CPU (docs/CONVENTIONS.md); 07 and 08 run two
# gloo ranks, so every smoke job asks for two cores.
SMOKE = {"cpus": 2, "mem": "8G", "time": "00:20:00"}
REPORT = {"cpus": 1, "mem": "4G", "time": "00:15:00"}
BENCH_TIME = "00:30:00"
BENCH_SMOKE_RANKS = 2

# States in which a job may still write into its run directory.
ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED",
                 "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT"}

_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")
_MEM = re.compile(r"^\d+[KMGT]?$")


class SlurmError(RuntimeError):
    """A submission or a job could not do its work (exit 1)."""


class SlurmUsageError(SlurmError):
    """Bad input: a flag, a config file, a run directory (exit 2)."""


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class SlurmOptions:
    """What every job asks of the scheduler beyond its own needs; from slurm.toml and flags."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None  # every notebook or benchmark job's limit; default: per notebook
    gpus_per_node: int | None = None  # GPUs of the jobs that use several (07, 08, --bench)
    constraint: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    extra: tuple[str, ...] = ()  # more "#SBATCH" options, e.g. "--exclusive"
    setup: tuple[str, ...] = ()  # shell lines run before the work, e.g. "module load cuda"
    python: str | None = None  # the interpreter on the compute nodes; default: this one

    @classmethod
    def from_record(cls, data: Mapping) -> SlurmOptions:
        """From checked values or a manifest's JSON (where the tuples came back as lists)."""
        return cls(**{k: tuple(v) if k in ("extra", "setup") else v for k, v in data.items()})


OPTION_KEYS = tuple(f.name for f in fields(SlurmOptions))


def _one_line(source: str, value) -> str:
    if not isinstance(value, str) or not value.strip() or "\n" in value or "\r" in value:
        raise SlurmUsageError(f"{source} must be a non-empty one-line string, got {value!r}")
    return value


def _check_option(key: str, value, *, source: str):
    """The value ``key`` holds in SlurmOptions, or a usage error naming ``source``."""
    if key in ("gpus_per_node", "cpus_per_task"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SlurmUsageError(f"{source} must be a whole number >= 1, got {value!r}")
        return value
    if key == "time":
        text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(text, str) or not _TIME.match(text):
            raise SlurmUsageError(f"{source}: {value!r} is not a Slurm time limit; write minutes, MM:SS, "
                                  "HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 01:30:00)")
        return text
    if key == "mem":
        text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(text, str) or not _MEM.match(text):
            raise SlurmUsageError(f"{source}: {value!r} is not a Slurm memory size; write e.g. 64G or 8000M")
        return text
    if key in ("extra", "setup"):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise SlurmUsageError(f"{source} must be a list of one-line strings, got {value!r}")
        lines = tuple(_one_line(f"{source} entry", v) for v in value)
        if key == "extra" and any(not v.startswith("-") for v in lines):
            raise SlurmUsageError(f"{source}: each entry is an sbatch option such as '--exclusive', got {list(lines)}")
        return lines
    return _one_line(source, value)


def load_config(path: Path) -> dict:
    """The options a slurm.toml sets, checked: an unknown key or a wrong type is a usage error."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SlurmUsageError(f"config file {path} does not exist; copy slurm.example.toml there "
                              "or drop --config") from None
    except tomllib.TOMLDecodeError as exc:
        raise SlurmUsageError(f"{path}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - set(OPTION_KEYS))
    if unknown:
        raise SlurmUsageError(f"{path.name}: unknown key {unknown[0]!r}; known keys: {', '.join(OPTION_KEYS)}")
    return {key: _check_option(key, value, source=f"{path.name}: {key}") for key, value in data.items()}


def merge_options(base: Mapping, overrides: Mapping) -> SlurmOptions:
    """``overrides`` (flags) win over ``base`` (the file, or a resumed run's record); extra sbatch
    lines and setup lines of both are kept, the overrides' last."""
    merged = dict(base)
    for key, value in overrides.items():
        if key in ("extra", "setup"):
            merged[key] = tuple(merged.get(key, ())) + tuple(value)
        else:
            merged[key] = value
    return SlurmOptions.from_record(merged)


# --------------------------------------------------------------------------- jobs and scripts


@dataclass(frozen=True)
class BenchSpec:
    """A torchrun benchmark spread over ``nodes`` nodes (submit --bench)."""

    module: str
    args: tuple[str, ...] = ()
    nodes: int = 1
    nproc_per_node: int | None = None  # default: the node's GPUs (full), 2 gloo ranks (smoke)


@dataclass(frozen=True)
class JobSpec:
    """One sbatch job: what it asks for and the shell lines that do its work."""

    name: str
    kind: str  # "notebook", "bench" or "report"
    cpus_per_task: int
    mem: str
    time: str
    gpus_per_node: int = 0
    nodes: int = 1
    work: tuple[str, ...] = ()


def _hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def notebook_job(name: str, *, profile: str, options: SlurmOptions, run_dir: Path, python: str) -> JobSpec:
    if profile == "smoke":
        gpus, cpus, mem, time = 0, SMOKE["cpus"], SMOKE["mem"], SMOKE["time"]
    else:
        need = runner.MIN_GPUS_FULL.get(name, 1)
        gpus = need if need == 1 else (options.gpus_per_node or need)
        if gpus < need:
            raise SlurmUsageError(f"{name} needs {need} GPUs on one node in the full profile; --gpus-per-node {gpus} "
                                  f"is too few: ask for {need} or more, or leave it out with --only")
        cpus, mem = FULL_CPUS_PER_GPU * gpus, f"{FULL_MEM_GB_PER_GPU * gpus}G"
        time = _hhmm(FULL_MINUTES.get(name, FULL_MINUTES_DEFAULT))
    work = (f"exec {python} -m systems.workbook.slurm notebook --run-dir {shlex.quote(str(run_dir))} {shlex.quote(name)}",)
    return JobSpec(name=name, kind="notebook", gpus_per_node=gpus, cpus_per_task=options.cpus_per_task or cpus,
                   mem=options.mem or mem, time=options.time or time, work=work)


def bench_job(bench: BenchSpec, *, profile: str, options: SlurmOptions, run_dir: Path, out_dir: Path,
              python: str) -> JobSpec:
    if profile == "smoke":
        gpus, nproc = 0, bench.nproc_per_node or BENCH_SMOKE_RANKS
        cpus, mem = nproc, SMOKE["mem"]  # a core per gloo rank
    else:
        gpus, nproc = options.gpus_per_node or 2, bench.nproc_per_node
        cpus, mem = FULL_CPUS_PER_GPU * gpus, f"{FULL_MEM_GB_PER_GPU * gpus}G"
    # without an explicit count the launcher takes SLURM_GPUS_ON_NODE: what the node really got
    nproc_flag = f" --nproc-per-node {nproc}" if nproc else ""
    launch = " ".join(shlex.quote(a) for a in (bench.module, *bench.args))
    work = (f"cd {shlex.quote(str(out_dir))}  # relative output paths of the benchmark land in the out dir",
            f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {python} -m systems.workbook.slurm torchrun{nproc_flag} {launch}",
            _done_marker_line(run_dir, "bench"))
    return JobSpec(name="bench", kind="bench", nodes=bench.nodes, gpus_per_node=gpus,
                   cpus_per_task=options.cpus_per_task or cpus, mem=options.mem or mem,
                   time=options.time or BENCH_TIME, work=work)


def report_job(*, run_dir: Path, python: str) -> JobSpec:
    work = (f"exec {python} -m systems.workbook.slurm report --run-dir {shlex.quote(str(run_dir))}",)
    return JobSpec(name="report", kind="report", cpus_per_task=REPORT["cpus"], mem=REPORT["mem"],
                   time=REPORT["time"], work=work)


def _marker(run_dir: Path, name: str, suffix: str) -> Path:
    return run_dir / "state" / f"{name}.{suffix}"


def _done_marker_line(run_dir: Path, name: str) -> str:
    path = shlex.quote(str(_marker(run_dir, name, "done")))
    return f"""printf '{{"job_id": "%s", "finished": "%s"}}\\n' "$SLURM_JOB_ID" "$(date -Iseconds)" > {path}"""


def render_script(job: JobSpec, *, options: SlurmOptions, run_dir: Path) -> str:
    """The sbatch script of ``job``: its #SBATCH header, the skip of finished work, the work."""
    sbatch = [f"--job-name=wb-{job.name}", f"--output={run_dir}/logs/{job.name}-%j.log",
              f"--nodes={job.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={job.cpus_per_task}",
              f"--mem={job.mem}", f"--time={job.time}"]
    if job.gpus_per_node:
        sbatch.append(f"--gpus-per-node={job.gpus_per_node}")
    for key in ("partition", "account", "qos"):
        if getattr(options, key):
            sbatch.append(f"--{key}={getattr(options, key)}")
    if options.constraint and job.kind != "report":  # the report needs no particular node
        sbatch.append(f"--constraint={options.constraint}")
    sbatch += options.extra
    lines = ["#!/bin/bash", *(f"#SBATCH {s}" for s in sbatch),
             f"# written by `python -m systems.workbook submit`; run dir {run_dir}",
             "set -eo pipefail"]
    if job.kind != "report":
        done = _marker(run_dir, job.name, "done")
        lines += [f"if [[ -e {shlex.quote(str(done))} ]]; then",
                  f"    echo {shlex.quote(f'{job.name} finished in an earlier job ({done}): not redone')}",
                  "    exit 0", "fi"]
    lines += [f"cd {shlex.quote(str(REPO_ROOT))}", *options.setup, *job.work]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- manifest


@dataclass
class JobRecord:
    name: str
    kind: str
    job_id: str
    script: str
    log: str
    depends_on: list[str] = field(default_factory=list)


@dataclass
class Attempt:
    number: int
    submitted: str
    parameters: dict
    jobs: list[JobRecord]


@dataclass
class Manifest:
    """What a run directory holds: the settings every attempt shares and the jobs of each."""

    run_dir: str
    out_dir: str
    profile: str
    notebooks: list[str]
    parameters: dict
    options: dict
    created: str
    git_commit: str | None = None
    bench: dict | None = None
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return ["bench"] if self.bench else list(self.notebooks)

    def latest_jobs(self) -> dict[str, tuple[int, JobRecord]]:
        """Each job name's last submission, with the attempt that made it."""
        latest: dict[str, tuple[int, JobRecord]] = {}
        for attempt in self.attempts:
            for job in attempt.jobs:
                latest[job.name] = (attempt.number, job)
        return latest

    def save(self) -> None:
        path = Path(self.run_dir) / MANIFEST
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)  # jobs read it while later jobs are being submitted: never half-written


def read_manifest(run_dir: Path) -> Manifest:
    path = Path(run_dir) / MANIFEST
    if not path.is_file():
        raise SlurmUsageError(f"{run_dir} holds no submission ({MANIFEST} missing): give a run directory "
                              "that `workbook submit` printed")
    data = json.loads(path.read_text())
    attempts = [Attempt(**{**a, "jobs": [JobRecord(**j) for j in a["jobs"]]}) for a in data.pop("attempts")]
    return Manifest(**data, attempts=attempts)


def latest_run_dir(root: Path = DEFAULT_ROOT) -> Path:
    """The run directory under ``root`` whose manifest was written last."""
    manifests = sorted(root.glob(f"*/{MANIFEST}"), key=lambda p: p.stat().st_mtime)
    if not manifests:
        raise SlurmUsageError(f"no submission under {root}: give the run directory (workbook status RUN_DIR)")
    return manifests[-1].parent


def new_run_dir(root: Path = DEFAULT_ROOT) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = root / stamp, 1
    while path.exists():  # two submissions within a second
        n += 1
        path = root / f"{stamp}-{n}"
    return path


# --------------------------------------------------------------------------- scheduler


def _run(cmd: list[str], *, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # a controller that does not answer: no state, no submission
        return subprocess.CompletedProcess(cmd, 124, "", f"{cmd[0]} did not answer within {timeout:g} s")


def job_states(job_ids: list[str]) -> dict[str, str]:
    """The scheduler's state of each job it still knows: sacct when accounting is on, then
    scontrol (which keeps a finished job for MinJobAge, 300 s by default)."""
    states: dict[str, str] = {}
    if not job_ids:
        return states
    if shutil.which("sacct"):
        proc = _run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(job_ids)])
        if proc.returncode == 0:
            for line in proc.stdout.splitlines():
                job, _, state = line.partition("|")
                if job in job_ids and state:
                    states[job] = state.split()[0]  # "CANCELLED by 1000"
    if shutil.which("scontrol"):
        for job in job_ids:
            if job not in states:
                proc = _run(["scontrol", "show", "job", "-o", job])
                m = re.search(r"\bJobState=(\S+)", proc.stdout) if proc.returncode == 0 else None
                if m:
                    states[job] = m.group(1)
    return states


def _sbatch(script: Path, *, dependency: list[str]) -> str:
    cmd = ["sbatch", "--parsable"] + ([f"--dependency=afterany:{':'.join(dependency)}"] if dependency else [])
    proc = _run([*cmd, str(script)])
    if proc.returncode != 0:
        message = (proc.stderr.strip() or proc.stdout.strip()).splitlines() or ["(no message)"]
        raise SlurmError(f"sbatch rejected {script.name}: {message[-1]}")
    return proc.stdout.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"


# --------------------------------------------------------------------------- submit


@dataclass(frozen=True)
class SubmitRequest:
    """A parsed `workbook submit`: either a new run or --resume of one."""

    only: tuple[str, ...] | None = None
    profile: str | None = None
    parameters: dict = field(default_factory=dict)
    file_options: dict = field(default_factory=dict)  # from slurm.toml (new runs only)
    flag_options: dict = field(default_factory=dict)
    run_dir: Path | None = None
    out_dir: Path | None = None
    resume: Path | None = None
    bench: BenchSpec | None = None
    dry_run: bool = False


def _plan_new(request: SubmitRequest) -> Manifest:
    profile = request.profile or "full"
    run_dir = (request.run_dir or new_run_dir()).resolve()
    if (run_dir / MANIFEST).exists():
        raise SlurmUsageError(f"{run_dir} already holds a submission: resume it with --resume {run_dir}, "
                              "or pick a new --run-dir")
    if run_dir.exists() and any(run_dir.iterdir()):
        raise SlurmUsageError(f"--run-dir {run_dir} is not empty: give a new or empty directory")
    if re.search(r"\s", str(run_dir)):
        raise SlurmUsageError(f"run dir {run_dir!s} contains whitespace, which #SBATCH lines cannot hold; pick another")
    runner.check_parameter_values(request.parameters)  # at submission, not in every job
    notebooks = [] if request.bench else [p.stem for p in runner.discover(list(request.only or ()))]
    options = merge_options(request.file_options, request.flag_options)
    return Manifest(run_dir=str(run_dir), out_dir=str((request.out_dir or run_dir).resolve()), profile=profile,
                    notebooks=notebooks, parameters=dict(request.parameters), options=asdict(options),
                    created=_now(), git_commit=git_commit(),
                    bench=asdict(request.bench) if request.bench else None)


def _plan_resume(request: SubmitRequest) -> Manifest:
    manifest = read_manifest(request.resume)
    run_dir = Path(manifest.run_dir)
    last = manifest.attempts[-1].jobs if manifest.attempts else []
    states = job_states([j.job_id for j in last]) if last else {}
    active = [f"{j.name} (job {j.job_id}, {states[j.job_id]})" for j in last if states.get(j.job_id) in ACTIVE_STATES]
    if active:
        raise SlurmError(f"{run_dir} still has jobs in the queue: {', '.join(active)}; wait for them "
                         "(workbook status) or scancel them, then resume")
    manifest.parameters = {**manifest.parameters, **request.parameters}
    runner.check_parameter_values(manifest.parameters)
    manifest.options = asdict(merge_options(manifest.options, request.flag_options))
    return manifest


def submit(request: SubmitRequest) -> Manifest:
    """Write the jobs' scripts and submit them (or print them with dry_run); the manifest."""
    manifest = _plan_resume(request) if request.resume else _plan_new(request)
    run_dir, out_dir = Path(manifest.run_dir), Path(manifest.out_dir)
    todo = [n for n in manifest.names if not _marker(run_dir, n, "done").exists()]
    if not todo and (manifest.bench or _marker(run_dir, "report", "done").exists()):
        print(f"every job of {run_dir} finished; nothing to submit"
              + ("" if manifest.bench else f" (report: {out_dir / 'writeup' / 'report.html'})"))
        return manifest
    options = SlurmOptions.from_record(manifest.options)
    python = shlex.quote(options.python or sys.executable)
    if manifest.bench:
        jobs = [bench_job(BenchSpec(**{**manifest.bench, "args": tuple(manifest.bench["args"])}),
                          profile=manifest.profile, options=options, run_dir=run_dir, out_dir=out_dir, python=python)]
    else:
        jobs = [notebook_job(n, profile=manifest.profile, options=options, run_dir=run_dir, python=python)
                for n in todo] + [report_job(run_dir=run_dir, python=python)]
    number = len(manifest.attempts) + 1
    scripts = [(job, run_dir / "jobs" / str(number) / f"{job.name}.sbatch",
                render_script(job, options=options, run_dir=run_dir)) for job in jobs]
    if request.dry_run:
        for job, path, text in scripts:
            after = ":".join(f"<job of {j.name}>" for j in jobs if j.kind == "notebook") if job.kind == "report" else ""
            print(f"{SCRIPT_SEPARATOR}{job.name}: sbatch --parsable"
                  + (f" --dependency=afterany:{after}" if after else "") + f" {path}")
            print(text, end="")
        return manifest
    if not shutil.which("sbatch"):
        raise SlurmError("sbatch is not on PATH: submit from a Slurm login node (--dry-run prints the scripts)")
    for sub in ("logs", "state", f"jobs/{number}"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest.save()  # before the first sbatch: a job can start at once and reads its settings here
    for name in todo:  # else a re-run's old failure would show until its job starts
        _marker(run_dir, name, "failed").unlink(missing_ok=True)
    _marker(run_dir, "report", "done").unlink(missing_ok=True)  # the new report job writes it again
    records: list[JobRecord] = []
    try:
        for job, path, text in scripts:
            path.write_text(text)
            after = [r.job_id for r in records] if job.kind == "report" else []
            job_id = _sbatch(path, dependency=after)
            records.append(JobRecord(name=job.name, kind=job.kind, job_id=job_id, script=str(path),
                                     log=str(run_dir / "logs" / f"{job.name}-{job_id}.log"), depends_on=after))
    except SlurmError as exc:
        if records:
            _run(["scancel", *(r.job_id for r in records)])
            submitted = ", ".join(r.job_id for r in records)
            raise SlurmError(f"{exc}; cancelled the jobs already submitted ({submitted})") from None
        raise
    manifest.attempts.append(Attempt(number=number, submitted=_now(), parameters=dict(manifest.parameters),
                                     jobs=records))
    manifest.save()
    skipped = [n for n in manifest.names if n not in todo]
    print(f"submitted {len(records)} jobs into {run_dir} ({manifest.profile} profile, attempt {number}"
          + (f"; finished before: {', '.join(skipped)}" if skipped else "") + ")")
    for r in records:
        print(f"  {r.name:<24} job {r.job_id:<8} {'after ' + ','.join(r.depends_on) + '  ' if r.depends_on else ''}"
              f"log {r.log}")
    print(f"status: python -m systems.workbook status {run_dir}\n"
          f"after a failure or a time-out: python -m systems.workbook submit --resume {run_dir}")
    return manifest


def _now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


# --------------------------------------------------------------------------- outcomes, report, status


@dataclass(frozen=True)
class Outcome:
    name: str
    state: str  # "finished", "failed", "not finished", "not submitted"
    detail: str = ""
    job_id: str | None = None
    attempt: int | None = None
    log: str | None = None
    scheduler: str | None = None  # the scheduler's state of that job, when it still knows it


def _running_cell(executed: Path) -> int | None:
    """The cell papermill marked running in a partial executed notebook (it saves on each cell start)."""
    try:
        cells = json.loads(executed.read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return None
    status = [c.get("metadata", {}).get("papermill", {}).get("status") for c in cells]
    return status.index("running") if "running" in status else None


def outcomes(manifest: Manifest, *, states: Mapping[str, str]) -> list[Outcome]:
    """Each job of the run: the markers first (they outlive the scheduler's memory of a job), then
    the scheduler's state, then what a partial executed notebook shows."""
    run_dir, latest = Path(manifest.run_dir), manifest.latest_jobs()
    names = manifest.names if manifest.bench else [*manifest.names, "report"]
    result = []
    for name in names:
        attempt, job = latest.get(name, (None, None))
        if job is None:
            result.append(Outcome(name=name, state="not submitted"))
            continue
        scheduler = states.get(job.job_id)
        where = dict(job_id=job.job_id, attempt=attempt, log=job.log, scheduler=scheduler)
        done, failed = _marker(run_dir, name, "done"), _marker(run_dir, name, "failed")
        if done.exists():
            record = json.loads(done.read_text() or "{}")
            took = f" in {record['seconds']:.0f} s" if "seconds" in record else ""
            result.append(Outcome(name=name, state="finished", detail=f"finished{took}", **where))
        elif scheduler in ACTIVE_STATES:
            result.append(Outcome(name=name, state="in the queue", **where))
        elif failed.exists():
            result.append(Outcome(name=name, state="failed", detail=json.loads(failed.read_text())["error"], **where))
        else:
            detail = f"ended without a result ({scheduler or 'state unknown to the scheduler'})"
            cell = _running_cell(Path(manifest.out_dir) / "writeup" / "executed" / f"{name}.ipynb")
            if cell is not None:
                detail += f"; cell {cell} was running when it stopped"
            result.append(Outcome(name=name, state="not finished", detail=detail, **where))
    return result


def _summary_html(manifest: Manifest, rows: list[Outcome], report_dir: Path) -> str:
    notebooks = [r for r in rows if r.name != "report"]
    finished = sum(r.state == "finished" for r in notebooks)
    items = []
    for r in notebooks:
        label = {"finished": "finished", "failed": "FAILED"}.get(r.state, r.state.upper())
        job = f" (job {r.job_id}, attempt {r.attempt}" if r.job_id else ""
        log = f', <a href="{html.escape(os.path.relpath(r.log, report_dir))}">log</a>' if r.log else ""
        items.append(f"<li><b>{html.escape(r.name)}</b>: {label}"
                     + (f": {html.escape(r.detail)}" if r.state != "finished" and r.detail else "")
                     + (f"{html.escape(job)}{log})" if job else "") + "</li>")
    return (f'<section id="slurm-run" style="margin: 1em 2em; padding: 0.5em 1em; border: 1px solid #999">'
            f"<h2>Slurm run: {finished} of {len(notebooks)} notebooks finished</h2>"
            f"<p>{html.escape(manifest.profile)} profile, run directory <code>{html.escape(manifest.run_dir)}</code>, "
            f"commit <code>{html.escape(str(manifest.git_commit))}</code></p><ul>{''.join(items)}</ul></section>")


def write_report(run_dir: Path) -> Path:
    """writeup/report.html from every executed notebook (partial ones too), headed by what
    finished and what failed where."""
    manifest = read_manifest(run_dir)
    out_dir = Path(manifest.out_dir)
    latest = manifest.latest_jobs()
    rows = outcomes(manifest, states=job_states([j.job_id for _, j in latest.values()]))
    report_dir = out_dir / "writeup"
    summary = _summary_html(manifest, rows, report_dir)
    try:
        path = report_html.build_report(out_dir)
        text = path.read_text()
    except report_html.ReportError:  # no notebook got as far as writing its executed copy
        report_dir.mkdir(parents=True, exist_ok=True)
        path, text = report_dir / "report.html", "<!DOCTYPE html>\n<html><body></body></html>\n"
    body = re.search(r"<body[^>]*>", text)
    at = body.end() if body else 0
    path.write_text(text[:at] + summary + text[at:])
    return path


def _print_status(run_dir: Path) -> None:
    manifest = read_manifest(run_dir)
    latest = manifest.latest_jobs()
    rows = outcomes(manifest, states=job_states([j.job_id for _, j in latest.values()]))
    last = manifest.attempts[-1] if manifest.attempts else None
    print(f"run dir {run_dir} ({manifest.profile} profile, "
          + (f"attempt {last.number} submitted {last.submitted})" if last else "never submitted)"))
    for r in rows:
        job = f"job {r.job_id} (attempt {r.attempt})" if r.job_id else "-"
        detail = r.detail if r.name != "report" else str(Path(manifest.out_dir) / "writeup" / "report.html")
        print(f"  {r.name:<22} {job:<22} {r.scheduler or '?':<11} {r.state:<13} {detail}")
        if r.log:
            print(f"  {'':<22} log {r.log}{'' if Path(r.log).exists() else ' (not written yet)'}")


# --------------------------------------------------------------------------- SLURM -> torchrun


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list in order: "gpu[01-03,07],cpu1" -> gpu01 gpu02 gpu03 gpu07 cpu1
    (what `scontrol show hostnames` prints; zero padding kept, several bracket groups multiply)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise SlurmUsageError(f"malformed Slurm node list {nodelist!r} (unbalanced brackets)")
        if ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    if depth or any(not item for item in items):
        raise SlurmUsageError(f"malformed Slurm node list {nodelist!r}")
    return [host for item in items for host in _expand_item(item, nodelist)]


def _expand_item(item: str, nodelist: str) -> list[str]:
    m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\](.*)", item)
    if m is None:
        if "[" in item or "]" in item:
            raise SlurmUsageError(f"malformed Slurm node list {nodelist!r}")
        return [item]
    prefix, ranges, rest = m.groups()
    numbers = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise SlurmUsageError(f"malformed range {part!r} in Slurm node list {nodelist!r}")
        numbers += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
    return [prefix + n + tail for n in numbers for tail in _expand_item(rest, nodelist)] if rest else \
        [prefix + n for n in numbers]


@dataclass(frozen=True)
class Rendezvous:
    """One node's torchrun launch in a multi-node job, and the env:// variables its ranks get."""

    master_addr: str
    master_port: int
    nnodes: int
    node_rank: int
    nproc_per_node: int

    def torchrun_args(self) -> list[str]:
        return ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                "--nproc-per-node", str(self.nproc_per_node),
                "--master-addr", self.master_addr, "--master-port", str(self.master_port)]

    def rank_env(self, local_rank: int) -> dict[str, str]:
        """What torchrun sets for local rank ``local_rank`` of this node (launch.run_from_env reads it)."""
        if not 0 <= local_rank < self.nproc_per_node:
            raise ValueError(f"local_rank must be in [0, {self.nproc_per_node}), got {local_rank}")
        return {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
                "RANK": str(self.node_rank * self.nproc_per_node + local_rank),
                "WORLD_SIZE": str(self.nnodes * self.nproc_per_node),
                "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(self.nproc_per_node)}


def port_for_job(job_id: int) -> int:
    # every node derives the same port from the job id without talking to the others; kept under
    # Linux's ephemeral range (32768+) so that no outgoing connection holds it already
    return 15000 + job_id % 17000


def rendezvous_from_slurm(env: Mapping[str, str], *, nproc_per_node: int | None = None) -> Rendezvous:
    """The torchrun rendezvous of this node from the variables Slurm sets in a job step.

    master: the first host of SLURM_JOB_NODELIST; nodes: SLURM_JOB_NUM_NODES (or SLURM_NNODES);
    this node: SLURM_NODEID; ranks per node: ``nproc_per_node``, else SLURM_GPUS_ON_NODE, else
    SLURM_NTASKS_PER_NODE; port: MASTER_PORT when set, else one derived from SLURM_JOB_ID.
    """
    def need(*names: str) -> str:
        for name in names:
            if env.get(name):
                return env[name]
        raise SlurmUsageError(f"{names[0]} is not set: start this inside a Slurm job step (srun, one task per node)")

    def count(name: str, text: str) -> int:
        m = re.match(r"(\d+)", text)  # SLURM_NTASKS_PER_NODE may read "4(x2)"
        if m is None:
            raise SlurmUsageError(f"{name}={text!r} is not a count")
        return int(m.group(1))

    hosts = expand_nodelist(need("SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    nnodes = count("SLURM_JOB_NUM_NODES", need("SLURM_JOB_NUM_NODES", "SLURM_NNODES"))
    if nnodes != len(hosts):
        raise SlurmUsageError(f"SLURM_JOB_NUM_NODES={nnodes} but the node list names {len(hosts)} hosts: {hosts}")
    node_rank = count("SLURM_NODEID", need("SLURM_NODEID"))
    if node_rank >= nnodes:
        raise SlurmUsageError(f"SLURM_NODEID={node_rank} is outside the job's {nnodes} nodes")
    if nproc_per_node is None:
        gpus = env.get("SLURM_GPUS_ON_NODE")
        nproc_per_node = int(gpus) if gpus and gpus.isdigit() and int(gpus) > 0 else \
            count("SLURM_NTASKS_PER_NODE", need("SLURM_NTASKS_PER_NODE"))
    if nproc_per_node < 1:
        raise SlurmUsageError(f"ranks per node must be >= 1, got {nproc_per_node}")
    port = count("MASTER_PORT", env["MASTER_PORT"]) if env.get("MASTER_PORT") else \
        port_for_job(count("SLURM_JOB_ID", need("SLURM_JOB_ID")))
    return Rendezvous(master_addr=hosts[0], master_port=port, nnodes=nnodes, node_rank=node_rank,
                      nproc_per_node=nproc_per_node)


# --------------------------------------------------------------------------- job side


def run_notebook_job(*, run_dir: Path, name: str) -> int:
    """One notebook inside its job: execute it, then leave state/NAME.done or state/NAME.failed."""
    manifest = read_manifest(run_dir)
    _marker(run_dir, name, "failed").unlink(missing_ok=True)
    path = runner.discover([name])[0]
    print(f"{name} ({manifest.profile}) -> {manifest.out_dir}", flush=True)
    run = runner.run_notebook(path, profile=manifest.profile, out_dir=Path(manifest.out_dir),
                                parameters=manifest.parameters, progress=False)
    record = {"job_id": os.environ.get("SLURM_JOB_ID"), "finished": _now(), "seconds": round(run.seconds, 1),
              "executed": str(run.output)}
    if run.ok:
        _marker(run_dir, name, "done").write_text(json.dumps(record) + "\n")
        print(f"{name}: ok in {run.seconds:.0f} s -> {run.output}", flush=True)
        return 0
    _marker(run_dir, name, "failed").write_text(json.dumps({**record, "error": run.error}) + "\n")
    print(f"FAILED {run.error}\n  partial output: {run.output}", file=sys.stderr, flush=True)
    return 1


def run_torchrun(*, module: str, args: list[str], nproc_per_node: int | None) -> int:
    """This node's torchrun, its rendezvous taken from the Slurm step's variables."""
    rdzv = rendezvous_from_slurm(os.environ, nproc_per_node=nproc_per_node)
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv.torchrun_args(), "-m", module, *args]
    print(f"node {rdzv.node_rank} of {rdzv.nnodes}: {shlex.join(cmd)}", flush=True)
    return subprocess.run(cmd).returncode


# --------------------------------------------------------------------------- command lines


def add_commands(sub) -> None:
    """`submit` and `status` on the `python -m systems.workbook` parser."""
    p = sub.add_parser("submit", help="submit the notebooks as Slurm jobs (one each, then a report job)",
                       description="Write one sbatch job per notebook and a report job that runs after them "
                       "(afterany), and submit them. Settings: built-in needs < slurm.toml (or --config) < flags.")
    p.add_argument("--only", nargs="+", help="notebook numbers or names, e.g. 01 03")
    p.add_argument("--profile", choices=PROFILES, help="full (default: the jobs ask for GPUs) or smoke (CPU only)")
    p.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="extra papermill parameter (JSON value, else string)")
    p.add_argument("--config", help=f"TOML file of Slurm settings (default: {CONFIG_NAME} in the repository "
                   "when present; see slurm.example.toml)")
    for key in ("partition", "account", "qos", "constraint"):
        p.add_argument(f"--{key}")
    p.add_argument("--time", help="limit of every notebook job (default: per notebook), e.g. 01:00:00")
    p.add_argument("--gpus-per-node", type=int, help="GPUs of the multi-GPU jobs (07, 08, --bench; default 2); "
                   "the others ask for one, the smoke profile for none")
    p.add_argument("--cpus-per-task", type=int, help="CPUs of every notebook job (default: 8 per GPU; smoke 2)")
    p.add_argument("--mem", help="memory of every notebook job (default: 64G per GPU; smoke 8G)")
    p.add_argument("--extra", action="append", default=[], metavar="=--OPTION",
                   help="one more #SBATCH line, written --extra=--exclusive (repeatable)")
    p.add_argument("--run-dir", help="the submission's directory (default: build/slurm/<timestamp>)")
    p.add_argument("--out-dir", help="where writeup/, figures/ and results/ go (default: the run dir)")
    p.add_argument("--resume", metavar="RUN_DIR", help="re-submit the jobs of RUN_DIR that did not finish")
    p.add_argument("--dry-run", action="store_true", help="print the scripts and sbatch commands; submit nothing")
    p.add_argument("--bench", metavar="MODULE", help="instead of notebooks: one torchrun job of MODULE "
                   "(e.g. systems.bench.ddp) over --nodes nodes; its arguments follow --")
    p.add_argument("--nodes", type=int, help="nodes of the --bench job (default 1)")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node of --bench (default: the node's GPUs; smoke 2)")
    p.add_argument("bench_args", nargs="*", metavar="-- MODULE_ARGS", help="arguments of the --bench module")
    s = sub.add_parser("status", help="the jobs of the last submission, their states and logs")
    s.add_argument("run_dir", nargs="?", help="a run directory (default: the newest under build/slurm)")


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that does not exist, or an empty name
        return False


def request_from_args(args: argparse.Namespace) -> SubmitRequest:
    """A SubmitRequest from `workbook submit`'s arguments, with every combination checked."""
    flags = {key: _check_option(key, getattr(args, key), source=f"--{key.replace('_', '-')}")
             for key in OPTION_KEYS if getattr(args, key, None) not in (None, [])}
    if args.resume:
        fixed = [f for f, v in (("--only", args.only), ("--profile", args.profile), ("--run-dir", args.run_dir),
                                ("--out-dir", args.out_dir), ("--bench", args.bench), ("--config", args.config))
                 if v is not None]
        if fixed:
            raise SlurmUsageError(f"--resume takes the run's notebooks, profile and directories from its manifest; "
                                  f"drop {', '.join(fixed)}")
    bench = None
    if args.bench:
        if args.only:
            raise SlurmUsageError("--bench runs a module instead of notebooks; drop --only")
        if (args.nodes is not None and args.nodes < 1) or (args.nproc_per_node is not None and args.nproc_per_node < 1):
            raise SlurmUsageError("--nodes and --nproc-per-node must be >= 1")
        # a typo would otherwise wait in the queue and fail inside the job
        if not _module_exists(args.bench):
            raise SlurmUsageError(f"--bench {args.bench}: no such module; give a measuring tool such as "
                                  "systems.bench.leaderboard (README, 'Running parts')")
        bench = BenchSpec(module=args.bench, args=tuple(args.bench_args), nodes=args.nodes or 1,
                          nproc_per_node=args.nproc_per_node)
    elif args.nodes not in (None, 1) or args.nproc_per_node is not None or args.bench_args:
        raise SlurmUsageError("--nodes, --nproc-per-node and arguments after -- belong to --bench MODULE "
                              "(a notebook runs on one node)")
    config = Path(args.config) if args.config else DEFAULT_CONFIG
    file_options = load_config(config) if (args.config or config.exists()) and not args.resume else {}
    return SubmitRequest(only=tuple(args.only) if args.only else None, profile=args.profile,
                         parameters={k: runner.parse_value(v) for k, v in args.parameter},
                         file_options=file_options, flag_options=flags,
                         run_dir=Path(args.run_dir) if args.run_dir else None,
                         out_dir=Path(args.out_dir) if args.out_dir else None,
                         resume=Path(args.resume) if args.resume else None, bench=bench, dry_run=args.dry_run)


def run_command(args: argparse.Namespace) -> int:
    """`workbook submit` / `workbook status`: 0, 1 when Slurm refused or failed, 2 on bad input."""
    try:
        if args.command == "status":
            _print_status(Path(args.run_dir).resolve() if args.run_dir else latest_run_dir())
        else:
            submit(request_from_args(args))
        return 0
    except (SlurmUsageError, runner.WorkbookError, report_html.ReportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SlurmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.workbook.slurm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    nb = sub.add_parser("notebook", help="execute one notebook of a run (inside its job)")
    nb.add_argument("--run-dir", required=True)
    nb.add_argument("name")
    rep = sub.add_parser("report", help="write the run's report.html (inside the report job)")
    rep.add_argument("--run-dir", required=True)
    tr = sub.add_parser("torchrun", help="torchrun on this node with the rendezvous of the Slurm step")
    tr.add_argument("--nproc-per-node", type=int)
    tr.add_argument("module")
    tr.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.command == "notebook":
            return run_notebook_job(run_dir=Path(args.run_dir), name=args.name)
        if args.command == "report":
            print(f"report: {write_report(Path(args.run_dir))}")
            record = {"job_id": os.environ.get("SLURM_JOB_ID"), "finished": _now()}
            _marker(Path(args.run_dir), "report", "done").write_text(json.dumps(record) + "\n")
            return 0
        return run_torchrun(module=args.module, args=args.args, nproc_per_node=args.nproc_per_node)
    except (SlurmUsageError, runner.WorkbookError, report_html.ReportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
