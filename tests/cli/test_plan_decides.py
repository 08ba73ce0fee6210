"""Every command asks the semantics plan whether a run is greedy and which selector draws (never `temperature == 0`
again): under `--semantics llamacpp`, `-t 0 --dynatemp-range 0.5` samples (llama.cpp's dynamic temperature runs T over
[0, 0.5]), so `sample -N` and `stream` sample too, draw what `sample --seed` draws, and say so."""

from __future__ import annotations

import json

DYNATEMP = ["-t", "0", "--semantics", "llamacpp", "--dynatemp-range", "0.5"]


def run_json(cli, *args):
    code, out, err = cli(*args, "--format", "json", "--threads", "1")
    assert code == 0, err
    return json.loads(out)


def one(cli, model, seed: int, *extra) -> dict:
    return run_json(cli, "sample", "Once upon", "-m", model, "-n", "8", *DYNATEMP, "--seed", str(seed), *extra)


def test_sample_n_samples_what_sample_seed_draws(cli, toy_model_dir):
    singles = [one(cli, toy_model_dir, s)["token_ids"] for s in (1, 2, 3)]
    assert len({tuple(t) for t in singles}) > 1  # the negative control: this setting samples in `sample`
    doc = one(cli, toy_model_dir, 1, "-N", "3", "--cache", "static")  # static: one row after another
    assert doc["selector"] == "multinomial"
    assert [r["token_ids"] for r in doc["samples"]] == singles
    assert doc["summary"]["distinct_outputs"] == len({tuple(t) for t in singles})
    batched = one(cli, toy_model_dir, 1, "-N", "3")  # full cache: the rows in one batch, each its own draws
    assert batched["summary"]["batched"] and batched["selector"] == "multinomial"
    assert [r["token_ids"] for r in batched["samples"]] == singles


def test_stream_samples_what_sample_draws(cli, toy_model_dir):
    for seed in (1, 2):
        sampled = one(cli, toy_model_dir, seed)
        streamed = run_json(cli, "stream", "Once upon", "-m", toy_model_dir, "-n", "8", "-t", "0", "--seed", str(seed),
                            "--set", "semantics=llamacpp", "--set", "dynatemp_range=0.5")
        assert streamed["selector"] == "multinomial"
        assert streamed["token_ids"] == sampled["token_ids"]


def test_a_batch_request_draws_what_sample_draws_with_xtc(cli, toy_model_dir, tmp_path):
    """XTC's coin and the selector's race come from one generator seeded by --seed, in `sample` and in each request
    of `batch` alike (two generators seeded alike would repeat the same draws for both)."""
    line = {"id": "x", "prompt": "Once upon", "temperature": 1.5, "xtc_probability": 0.7, "xtc_threshold": 0.01,
            "seed": 4}
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(line) + "\n")
    doc = run_json(cli, "batch", "--prompts-file", path, "-m", toy_model_dir, "-n", "10", "--ignore-eos",
                   "--baselines", "none")
    single = run_json(cli, "sample", "Once upon", "-m", toy_model_dir, "-n", "10", "--ignore-eos", "-t", "1.5",
                      "--xtc-probability", "0.7", "--xtc-threshold", "0.01", "--seed", "4")
    assert doc["requests"][0]["token_ids"] == single["token_ids"]


def test_stream_draws_what_sample_draws_with_xtc(cli, toy_model_dir):
    xtc = ["-n", "10", "--ignore-eos", "-t", "1.5", "--seed", "4"]
    single = run_json(cli, "sample", "Once upon", "-m", toy_model_dir, *xtc, "--xtc-probability", "0.7",
                      "--xtc-threshold", "0.01")
    streamed = run_json(cli, "stream", "Once upon", "-m", toy_model_dir, *xtc, "--set", "xtc_probability=0.7",
                        "--set", "xtc_threshold=0.01")
    assert streamed["token_ids"] == single["token_ids"]
