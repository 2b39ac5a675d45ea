"""Execute the numbered notebooks headless with papermill and export one HTML report, on this
machine (``run``) or as Slurm batch jobs (``submit``, ``status``): ``python -m systems.workbook --help``.

- ``notebooks``: discovery, one notebook, a run of several (papermill);
- ``html``: the report built from the executed notebooks;
- ``slurm``: job scripts, submission, resume, status, and the SLURM -> torchrun rendezvous;
- ``cli``: the command line.
"""

from systems.workbook.cli import main
from systems.workbook.html import ReportError, build_report
from systems.workbook.notebooks import (MIN_GPUS_FULL, NotebookRun, WorkbookError, default_out_dir, default_profile,
                                        discover, parse_value, run_notebook, run_notebooks, to_ipynb)

__all__ = ["MIN_GPUS_FULL", "NotebookRun", "ReportError", "WorkbookError", "build_report", "default_out_dir",
           "default_profile", "discover", "main", "parse_value", "run_notebook", "run_notebooks", "to_ipynb"]
