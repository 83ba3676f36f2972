"""lm-eval against a running server: the course's shipped tasks through lm-eval's `local-completions` model.

    run = run_lm_eval(url)              # url: a `python -m nanoserve serve` base URL; the `lm_eval` command
    run.metrics   # {"course_line_mc": {"acc": 0.35, "acc_stderr": 0.07}, "course_line_gen": {"exact_match": ...}}
    run.samples   # {task: one dict per item, in item order: lm-eval's scores of it (see `compact_samples`)}
    runs = run_lm_eval_each([url_a, url_b])   # several servers at once, one lm-eval process through its Python API

lm-eval runs in its own process group under a hard timeout, offline: the tasks and their items come from
benchmarks/lm_eval/ and the tokenizer from the model's directory, never from a hub. It sends batches of
`batch_size` token-id prompts per request (multiple choice: `echo` with `logprobs=1` and `max_tokens=1`, reading the
prompt's log-probabilities; generate-until: greedy with `stop`), `num_concurrent` requests at a time (by default
8 of 4: 32 prompts in flight, what the server decodes together by default).

The `lm_eval` command indexes every task bundled with lm-eval (some 14,000 YAML files, several seconds on a small
CPU) before it runs ours; `run_lm_eval_each` calls `lm_eval.simple_evaluate`, the function the command ends in,
with a task manager that knows only ours, for every server at once in one process (a thread each: one server on
a core or less waits on its forwards, and the others' requests fill the other core).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from nanoserve.course.evals import GEN_TASK, MC_TASK, TASK_DIR

LM_EVAL = Path(sys.executable).with_name("lm_eval")   # the CLI installed beside this Python
# never a hub; and one thread: lm-eval's own work is light, and the cores belong to the server
LM_EVAL_ENV = dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
TASKS = (MC_TASK, GEN_TASK)


@dataclass(frozen=True)
class LmEvalRun:
    metrics: dict[str, dict[str, float]]   # {task: {metric: value}}, lm-eval's aggregate (its "none" filter)
    samples: dict[str, list[dict]]         # {task: per item, in item order}
    seconds: float                         # lm-eval's run against this server (beside the others' runs)


def model_args(base_url: str, model: str = "course", tokenizer: str | Path | None = None, num_concurrent: int = 8,
               max_length: int = 1024) -> dict:
    """local-completions' arguments: our server's completions route, the tokenizer of the model's directory."""
    from nanoserve.models.shipped import COURSE_MODEL
    return dict(base_url=f"{base_url.rstrip('/')}/v1/completions", model=model,
                tokenizer=str(tokenizer or COURSE_MODEL), tokenizer_backend="huggingface", max_length=max_length,
                num_concurrent=num_concurrent, max_retries=1, timeout=60)


def lm_eval_command(args: dict, output_dir: Path, tasks=TASKS, batch_size: int = 4) -> list[str]:
    return [str(LM_EVAL), "run", "--model", "local-completions",
            "--model_args", ",".join(f"{k}={v}" for k, v in args.items()),
            "--tasks", ",".join(tasks), "--include_path", str(TASK_DIR), "--batch_size", str(batch_size),
            "--output_path", str(output_dir), "--log_samples"]


def run_lm_eval(base_url: str, model: str = "course", tokenizer: str | Path | None = None, tasks=TASKS,
                batch_size: int = 4, num_concurrent: int = 8, timeout_s: float = 120.0) -> LmEvalRun:
    """Runs the `lm_eval` command (`local-completions` on `tasks`) against the server at `base_url` (serving `model`),
    with the tokenizer of the model directory `tokenizer` (default: the course model's). Past `timeout_s` seconds
    its process group is killed; a failure raises with the tail of lm-eval's log."""
    with tempfile.TemporaryDirectory(prefix="lm_eval-") as tmp:
        out = Path(tmp) / "out"
        args = model_args(base_url, model, tokenizer, num_concurrent)
        seconds = run_process(lm_eval_command(args, out, tasks, batch_size), Path(tmp) / "lm_eval.log", timeout_s,
                              base_url)
        return LmEvalRun(cli_metrics(out), {task: cli_samples(out, task) for task in tasks}, seconds)


def run_lm_eval_each(base_urls: list[str], model: str = "course", tokenizer: str | Path | None = None, tasks=TASKS,
                     batch_size: int = 4, num_concurrent: int = 8, timeout_s: float = 120.0) -> list[LmEvalRun]:
    """lm-eval against each server, all at once, in one process (`python -m nanoserve.course.lmeval`) that imports
    lm-eval once; the runs in the order of `base_urls`. The timeout covers them all."""
    with tempfile.TemporaryDirectory(prefix="lm_eval-") as tmp:
        out = Path(tmp) / "runs.json"
        cmd = [sys.executable, "-m", "nanoserve.course.lmeval", "--out", str(out), "--model", model,
               "--batch-size", str(batch_size), "--num-concurrent", str(num_concurrent), "--tasks", *tasks,
               "--urls", *base_urls] + (["--tokenizer", str(tokenizer)] if tokenizer else [])
        run_process(cmd, Path(tmp) / "lm_eval.log", timeout_s, ", ".join(base_urls))
        return [LmEvalRun(**run) for run in json.loads(out.read_text())]


def run_process(cmd: list[str], log_path: Path, timeout_s: float, against: str) -> float:
    """Runs `cmd` as the other clients run (`serve.clients.run_bounded`: a timeout kills it and anything it
    started); its seconds, or an error naming lm-eval and the servers with the tail of its log."""
    from nanoserve.serve.clients import run_bounded
    return run_bounded(f"lm-eval against {against}", cmd, log_path, timeout_s, env=os.environ | LM_EVAL_ENV)


def compact_metrics(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's "results" ("acc,none" read as "acc"; text fields left out)."""
    return {task: {key.split(",")[0]: float(value) for key, value in row.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
            for task, row in results.items()}


def compact_samples(task: str, rows: list[dict]) -> list[dict]:
    """lm-eval's per-item records of `task`, in item order: multiple choice, each choice's summed log-probability
    (`loglikelihoods`) and `acc`; generate-until, the generated `text` and `exact_match`."""
    rows = sorted(rows, key=lambda r: r["doc_id"])
    if task == GEN_TASK:
        return [dict(text=r["filtered_resps"][0], exact_match=float(r["exact_match"])) for r in rows]
    # each choice's (log-likelihood, is-greedy); the command's samples file writes them as strings
    return [dict(loglikelihoods=[float(ll) for ll, _greedy in r["filtered_resps"]], acc=float(r["acc"])) for r in rows]


def only(paths: list[Path], what: str, out: Path) -> Path:
    if len(paths) != 1:
        raise FileNotFoundError(f"expected one lm-eval {what} under {out}, found {[p.name for p in paths]}")
    return paths[0]


def cli_metrics(out: Path) -> dict[str, dict[str, float]]:
    results = only(sorted(out.rglob("results_*.json")), "results file", out)
    return compact_metrics(json.loads(results.read_text())["results"])


def cli_samples(out: Path, task: str) -> list[dict]:
    path = only(sorted(out.rglob(f"samples_{task}_*.jsonl")), f"samples file of {task}", out)
    return compact_samples(task, [json.loads(s) for s in path.read_text().splitlines()])


def main() -> None:
    """The process of `run_lm_eval_each`: lm-eval's Python API against every server at once, a thread each (once
    imported, lm-eval costs about a tenth of a second of CPU per server), the runs written as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--urls", nargs="+", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="course")
    p.add_argument("--tokenizer")
    p.add_argument("--tasks", nargs="+", default=list(TASKS))
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-concurrent", type=int, default=8)
    a = p.parse_args()
    import lm_eval
    import transformers
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager, get_task_dict

    # What an evaluation imports lazily on first use (transformers' AutoTokenizer, the model client, the tasks'
    # dataset function) is imported here first: two threads importing one module at once can see it half made.
    _ = transformers.AutoTokenizer                    # a lazy attribute: the first access imports it
    get_model("local-completions")
    get_task_dict(a.tasks, TaskManager(include_path=str(TASK_DIR), include_defaults=False))

    def run(url: str) -> dict:   # each thread its own task manager: one thread's tasks are never another's objects
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model="local-completions", tasks=a.tasks, batch_size=a.batch_size,
                                      model_args=model_args(url, a.model, a.tokenizer, a.num_concurrent),
                                      task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
                                      log_samples=True)
        return dict(metrics=compact_metrics(out["results"]), seconds=time.perf_counter() - t0,
                    samples={task: compact_samples(task, out["samples"][task]) for task in a.tasks})

    with ThreadPoolExecutor(len(a.urls)) as pool:
        runs = list(pool.map(run, a.urls))
    a.out.write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
