"""lm-eval against our server: the course's shipped tasks (benchmarks/lm_eval/), run by lm-eval's
`local-completions` model over /v1/completions with batches of 4 prompts, score every item as the offline engine
does (nanoserve.course.evals.score_offline), through the `lm_eval` command and through lm-eval's Python API alike.

One server on a free loopback port; lm-eval runs in its own process group under a hard timeout. The server and
the offline engine each run one thread: on two shared cores a team of threads per process only waits on the others."""
import os
import socket
import sys

import pytest
import torch

from nanoserve import LLM
from nanoserve.course import evals, lmeval
from nanoserve.ports import free_port
from nanoserve.serve.load import start_server

pytestmark = pytest.mark.slow
SERVE = [sys.executable, "-m", "nanoserve", "serve", "--host", "127.0.0.1", "--max-model-len", "1024"]


def test_the_shipped_items_are_what_the_generator_writes():
    shipped = evals.read_items()
    assert shipped == evals.make_items()
    assert all(len(items) == evals.NUM_ITEMS for items in shipped.values())
    assert all(len(set(it["choices"])) == evals.NUM_CHOICES for it in shipped[evals.MC_TASK])
    # the offline scorer generates as far as lm-eval asks the server to
    assert f"max_gen_toks: {evals.MAX_GEN_TOKENS}\n" in (evals.TASK_DIR / f"{evals.GEN_TASK}.yaml").read_text()


def offline_scores() -> dict:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return evals.score_offline(LLM(max_model_len=1024), evals.read_items())
    finally:
        torch.set_num_threads(before)


def test_lm_eval_over_the_server_scores_every_item_as_the_offline_engine():
    port = free_port()
    with start_server(SERVE + ["--port", str(port)], port, env=os.environ | {"OMP_NUM_THREADS": "1"}) as url:
        run = lmeval.run_lm_eval(url, batch_size=4, num_concurrent=8, timeout_s=90)
        # the Python API path, two evaluations at once (threads: chapter 07 runs three, one per server)
        api_runs = lmeval.run_lm_eval_each([url, url], batch_size=4, num_concurrent=8, timeout_s=60)
    offline = offline_scores()
    ours = evals.accuracy(offline)
    # each evaluation of the Python API path is held to the same standard as the command
    for lm_eval in (run, *api_runs):
        assert evals.disagreements(lm_eval.samples, offline) == []
        # Near-ties (a lead under evals.TIE_NATS) are the only items allowed to differ, so the accuracies may differ
        # by those (in practice there are none, and the log-likelihoods agree to 1e-5 or better, often to the bit)
        for task, metric in ((evals.MC_TASK, "acc"), (evals.GEN_TASK, "exact_match")):
            ties = sum(s["margin"] < evals.TIE_NATS for s in offline[task])
            got = lm_eval.metrics[task][metric]
            assert got == pytest.approx(sum(s[metric] for s in lm_eval.samples[task]) / evals.NUM_ITEMS)
            assert abs(got - ours[task]) <= ties / evals.NUM_ITEMS, (task, got, ours[task])


def test_a_hung_lm_eval_is_killed_at_its_timeout():
    """lm-eval against a server that never answers: its process group is killed at the timeout (2 s, still in its
    start-up: the kill is the same wherever it is)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(TimeoutError, match="lm-eval against .* did not finish within 2 s"):
            lmeval.run_lm_eval(url, timeout_s=2)
