"""Preference training (data.format preference; ds_train/train/preference.py, ds_train/train/reference.py): the
losses and their metrics against their closed forms, preference records and their prepared pairs,
bad pairs named or counted, and through the real launcher: live and precomputed references, ZeRO-3
on 2 processes against ZeRO-0 on 1, an exact resume, LoRA and the export."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, TINY_MODEL, deepspeed_train, expect_error, tiny_config, write_config
from ds_train.config.file import build_config
from ds_train.data.chat import Renderer, preference
from ds_train.data.datasets import rank_micro_batches
from ds_train.data.examples import IGNORE
from ds_train.data.pairs import PreferenceData
from ds_train.data.prepare import prepare
from ds_train.errors import UserError
from ds_train.model.build import INIT_SCHEME
from ds_train.train.preference import mean_metrics, pair_sums, preference_loss, sequence_logps
from test_chat import CHATML
from test_checkpoint import metrics_by_step

LOG2 = math.log(2)


def closed_form(pc, pr, rc, rr, beta, loss, eps):
    h = (pc - rc) - (pr - rr)
    logsig = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
    value = (h - 1 / (2 * beta)) ** 2 if loss == "ipo" else -(1 - eps) * logsig(beta * h) - eps * logsig(-beta * h)
    return value, beta * (pc - rc), beta * (pr - rr)


@pytest.mark.parametrize("loss, beta, eps", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0),
                                             ("ipo", 0.7, 0.0), ("sigmoid_norm", 0.3, 0.1)])
def test_each_loss_and_its_metrics_equal_their_closed_forms(loss, beta, eps):
    import torch

    pc, pr = torch.tensor([-12.5, -3.25, -40.0, -7.0], dtype=torch.float64), torch.tensor([-14.0, -2.0, -39.0, -7.0],
                                                                                          dtype=torch.float64)
    rc, rr = torch.tensor([-13.0, -3.0, -41.5, -6.0], dtype=torch.float64), torch.tensor([-13.5, -2.5, -38.0, -8.5],
                                                                                         dtype=torch.float64)
    losses, chosen, rejected = preference_loss(pc, pr, rc, rr, beta, loss, eps)
    want = [closed_form(*(float(t[i]) for t in (pc, pr, rc, rr)), beta, loss, eps) for i in range(4)]
    for i, (value, c, r) in enumerate(want):
        assert abs(float(losses[i]) - value) <= 1e-7 and abs(float(chosen[i]) - c) <= 1e-7
        assert abs(float(rejected[i]) - r) <= 1e-7
    metrics = mean_metrics(pair_sums(losses, chosen, rejected, pc, pr), 4)
    assert abs(metrics["loss"] - sum(w[0] for w in want) / 4) <= 1e-7
    assert abs(metrics["rewards/chosen"] - sum(w[1] for w in want) / 4) <= 1e-7
    assert abs(metrics["rewards/rejected"] - sum(w[2] for w in want) / 4) <= 1e-7
    assert abs(metrics["rewards/margins"] - sum(w[1] - w[2] for w in want) / 4) <= 1e-7
    assert metrics["rewards/accuracies"] == sum(w[1] > w[2] for w in want) / 4
    assert abs(metrics["logps/chosen"] - float(pc.mean())) <= 1e-7
    # the policy equal to its reference: every sigmoid loss is log 2, IPO's is 1 / (4 beta^2)
    same, _, _ = preference_loss(pc, pr, pc, pr, beta, loss, eps)
    assert torch.allclose(same, torch.full_like(same, 1 / (4 * beta ** 2) if loss == "ipo" else LOG2), atol=1e-12)


def test_sequence_log_probs_sum_the_targets_alone():
    import torch

    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    targets = torch.tensor([[3, IGNORE, 1, 6, IGNORE], [IGNORE, IGNORE, IGNORE, 2, 0]])
    sums, counts = sequence_logps(logits, targets)
    logp = torch.log_softmax(logits.float(), -1)
    want = [float(logp[0, 0, 3] + logp[0, 2, 1] + logp[0, 3, 6]), float(logp[1, 3, 2] + logp[1, 4, 0])]
    assert counts.tolist() == [3, 2] and all(abs(float(s) - w) <= 1e-6 for s, w in zip(sums, want))


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "sigmoid_norm"])
def test_pair_losses_normalise_ipo_and_sigmoid_norm_per_target_token(loss):
    """pair_losses on a model's forward: IPO and sigmoid_norm compare per-token mean log-probs (policy
    and reference each divided by the row's target count), sigmoid the sums; chosen and rejected rows
    with 3 and 6 targets, so a missing or doubled division shows."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.config import DpoConfig
    from ds_train.data.pairs import PairBatch
    from ds_train.train.preference import pair_losses

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY_MODEL, "vocab_size": 50}))
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 50, (4, 8))
    targets = np.full((4, 8), IGNORE)
    for row, n in enumerate((3, 6, 6, 3)):  # chosen 0, 1 then rejected 0, 1
        targets[row, 8 - n:] = rng.integers(0, 50, n)
    batch = PairBatch(inputs, targets, None, pairs=np.array([0, 1]))
    ref = torch.tensor([-30.0, -55.0, -62.0, -27.0], dtype=torch.float64)
    dpo = DpoConfig(beta=0.3, loss=loss)
    with torch.no_grad():
        losses, _ = pair_losses(model, batch, lambda b: ref, dpo)
        logps, counts = sequence_logps(model(input_ids=torch.from_numpy(inputs)).logits, torch.from_numpy(targets))
    assert counts.tolist() == [3, 6, 6, 3]
    pol, rf = logps.double(), ref
    if loss != "sigmoid":
        pol, rf = pol / counts, rf / counts
    for i in range(2):
        want, _, _ = closed_form(float(pol[i]), float(pol[2 + i]), float(rf[i]), float(rf[2 + i]), 0.3,
                                 "ipo" if loss == "ipo" else "sigmoid", 0.0)
        assert abs(float(losses[i]) - want) <= 1e-5 * max(1.0, abs(want)), (loss, i, float(losses[i]), want)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from ds_train.data.tokenizer import train_tokenizer

    texts = [f"<|im_start|>user\nTell me about {n}.<|im_end|>\n<|im_start|>assistant\n{n} is kind. {n} is rude."
             f"<|im_end|>\n" for n in ("Ada", "Bruno", "Chen")] * 20
    return train_tokenizer(texts, 300, tmp_path_factory.mktemp("tok"))


def targets_text(tok, tokens, mask) -> str:
    return tok.decode([t for t, m in zip(tokens.tolist(), mask.tolist()) if m])


def test_a_pair_renders_its_prompt_once_per_side_with_targets_on_the_completion_alone(tok):
    r = Renderer(tok, CHATML)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "Tell me about Ada."}]
    for record in ({"prompt": history, "chosen": "Ada is kind.", "rejected": "Ada is rude."},
                   {"chosen": [*history, {"role": "assistant", "content": "Ada is kind."}],  # implicit prompt
                    "rejected": [*history, {"role": "assistant", "content": "Ada is rude."}]}):
        prompt, chosen, rejected = preference(record, "p.jsonl:1")
        assert prompt == history and chosen[0]["content"] == "Ada is kind." and rejected[0]["content"] == "Ada is rude."
        for side, text in ((chosen, "Ada is kind."), (rejected, "Ada is rude.")):
            tokens, mask = r.encode_completion(prompt, side, "p.jsonl:1")
            assert tok.decode(tokens.tolist()) == r.render(prompt + side)
            assert targets_text(tok, tokens, mask) == f"{text}<|im_end|>\n"  # not the earlier "Hello."


@pytest.mark.parametrize("record, said", [
    ({"prompt": "hi", "chosen": "a"}, "p.jsonl:3: no 'rejected' field (data.format preference reads 'prompt', "
                                      "'chosen' and 'rejected')"),
    ({"prompt": "hi", "rejected": "a"}, "p.jsonl:3: no 'chosen' field"),
    ({"chosen": "a", "rejected": "b"}, "p.jsonl:3: no 'prompt' field, and 'chosen' is 'a', not a conversation"),
    ({"prompt": "hi", "chosen": 3, "rejected": "b"}, "p.jsonl:3: 'chosen' is 3, not a string or a list of messages"),
    ({"prompt": "hi", "chosen": [{"role": "user", "content": "x"}], "rejected": "b"},
     "p.jsonl:3: 'chosen' has no assistant turn after the prompt (roles: user)"),
    ({"prompt": "hi", "chosen": "a", "rejected": [{"role": "assistant"}]}, "p.jsonl:3: rejected[0] has no 'content'"),
    ({"prompt": [{"role": "judge", "content": "x"}], "chosen": "a", "rejected": "b"},
     "p.jsonl:3: prompt[0].role is 'judge', not one of"),
])
def test_bad_pairs_name_the_record_and_the_field(record, said):
    with pytest.raises(UserError) as e:
        preference(record, "p.jsonl:3")
    assert str(e.value).startswith(said), str(e.value)


def pairs_file(path: Path, n: int = 40, extra: list | None = None) -> Path:
    rows = [{"prompt": f"Tell me about {name}{i}.", "chosen": f"{name}{i} is kind.", "rejected": f"{name}{i} is rude."}
            for i in range(n) for name in ("Ada",)]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, *(extra or [])]))
    return path


def test_prepared_pairs_stay_whole_and_bad_ones_are_counted_and_said(tmp_path, capfd):
    """Identical pairs are left out by prepare (counted, the first named); a pair with a side longer
    than seq_len is dropped or truncated (counted); a micro-batch holds whole pairs, chosen rows
    first; each data-parallel rank reads other pairs."""
    long = "very " * 80
    src = pairs_file(tmp_path / "p.jsonl", extra=[
        {"prompt": "Same?", "chosen": "Yes.", "rejected": "Yes."},
        {"prompt": "Long?", "chosen": "Short.", "rejected": f"It is {long}long."},
        {"prompt": "Same again?", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "x"}])
    out = tmp_path / "data"
    meta = prepare([str(src)], out, vocab_size=300, val_fraction=0.2, fmt="preference", chat_template=CHATML)
    err = capfd.readouterr().err
    assert f"2 pair(s) whose chosen and rejected are the same left out (nothing to prefer), the first at {src}:41" in err
    assert meta["identical_pairs"] == 2 and meta["format"] == "preference"
    assert (meta["train_documents"] + meta["val_documents"]) == 2 * 41  # examples: two per pair
    assert meta["train_documents"] % 2 == 0 and meta["val_documents"] % 2 == 0
    pad = meta["eos_token_id"]
    splits = {split: [PreferenceData(out, split, meta["dtype"], 48, 1, policy, pad) for policy in ("drop", "truncate")]
              for split in ("train", "val")}
    assert sum(dropped.overlong for dropped, _ in splits.values()) == 1  # the long pair, in one split or the other
    for dropped, cut in splits.values():
        assert dropped.num_samples == dropped.pairs_total - dropped.overlong and cut.overlong == dropped.overlong
        assert cut.num_samples == cut.pairs_total
        if dropped.overlong:
            assert "1 with a side longer than train.seq_len=48 dropped (data.overlong)" in dropped.summary()
            assert "1 with a side longer than train.seq_len=48 truncated (data.overlong)" in cut.summary()
    dropped = splits["train"][0]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    seen = []
    for rank in (0, 1):
        batches = rank_micro_batches(dropped, 0, 8, 2, rank, 2)
        assert len(batches) == 2
        for b in batches:
            assert b.inputs.shape[0] == 4 and b.positions is None and len(b.pairs) == 2
            for i, p in enumerate(b.pairs.tolist()):
                chosen = tok.decode([t for t in b.targets[i].tolist() if t != IGNORE])
                rejected = tok.decode([t for t in b.targets[i + 2].tolist() if t != IGNORE])
                assert chosen.endswith("is kind.<|im_end|>\n") and rejected.endswith("is rude.<|im_end|>\n")
                assert chosen.split()[0] == rejected.split()[0]  # the same pair's two sides
                seen.append(p)
    assert len(seen) == len(set(seen)) == 8


def test_bad_preference_input_is_one_line_naming_file_row_and_field(tmp_path):
    src = pairs_file(tmp_path / "p.jsonl", n=5, extra=[{"prompt": "hi", "chosen": "a"}])
    cfg = tiny_config(tmp_path / "data", tmp_path / "run", data={"dir": str(tmp_path / "data"), "sources": [str(src)],
                                                                  "format": "preference", "chat_template": CHATML,
                                                                  "vocab_size": 300})
    path = write_config(tmp_path / "c.yaml", cfg)
    expect_error(["train", "--config", str(path), "--ds-config", str(ROOT / "ds_configs" / "zero0.json")],
                 f"{src}:6: no 'rejected' field (data.format preference reads 'prompt', 'chosen' and 'rejected')")
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()
    import pyarrow as pa
    import pyarrow.parquet as pq

    same = tmp_path / "same.jsonl"
    same.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "b"}) + "\n")
    with pytest.raises(UserError, match=f"data.sources: all 1 preference pairs have the same chosen and rejected "
                                        f"\\(the first at {same}:1\\): nothing to prefer"):
        prepare([str(same)], tmp_path / "d1", vocab_size=300, fmt="preference", chat_template=CHATML)
    assert not (tmp_path / "d1").exists()
    pq.write_table(pa.table({"prompt": ["a"], "answer": ["b"]}), tmp_path / "t.parquet")
    with pytest.raises(UserError, match="t.parquet: no 'chosen' and 'rejected' columns \\(columns: prompt, answer\\); "
                                        "data.format preference reads pairs from those"):
        prepare([str(tmp_path / "t.parquet")], tmp_path / "d2", vocab_size=300, fmt="preference", chat_template=CHATML)


def test_the_dpo_section_is_checked():
    base = {"model": {"config": dict(TINY_MODEL)}, "data": {"format": "preference"}}
    assert build_config(base).dpo.loss == "sigmoid" and build_config(base).dpo.reference == "precomputed"
    with pytest.raises(UserError, match="dpo.label_smoothing: applies to the losses sigmoid, sigmoid_norm; ipo has "
                                        "none"):
        build_config({**base, "dpo": {"loss": "ipo", "label_smoothing": 0.1}})
    with pytest.raises(UserError, match=r"dpo.label_smoothing: 0.5 must be within \[0, 0.5\) \(0.5 would make"):
        build_config({**base, "dpo": {"label_smoothing": 0.5}})
    with pytest.raises(UserError, match="parallel.sequence: 2 splits each sequence over ranks, and preference"):
        build_config({**base, "parallel": {"sequence": 2}})
    with pytest.raises(UserError, match="dpo.reference: live with parallel.tensor=2: ds_train builds the reference "
                                        "without AutoTP's split"):
        build_config({**base, "dpo": {"reference": "live"}, "parallel": {"tensor": 2}})
    with pytest.raises(UserError, match="config: dpo.loss: 'kto' is not one of"):
        build_config({**base, "dpo": {"loss": "kto"}})


# ---- through the real launcher ----

@pytest.fixture(scope="module")
def pref_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pref")
    shutil.copy(ROOT / "recipes" / "data" / "preference_pairs.jsonl", out / "pairs.jsonl")
    lines = (out / "pairs.jsonl").read_text().splitlines()[:400]
    (out / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    prepare([str(out / "pairs.jsonl")], out / "data", vocab_size=400, val_fraction=0.1, fmt="preference",
            chat_template=CHATML)
    return out / "data"


def dpo_run(data: Path, run_dir: Path, **sections) -> Path:
    dpo, optim = sections.pop("dpo", {}), sections.pop("optim", {})
    cfg = tiny_config(data, run_dir, data={"dir": str(data), "format": "preference"},
                      train={"max_steps": 7, "micro_batch_size": 2, "global_batch_size": 8, "seq_len": 64,
                             "eval_every": 7, "eval_batches": 2},
                      optim={"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0, **optim}, dpo={"beta": 0.2, **dpo},
                      **sections)
    return write_config(run_dir.parent / f"{run_dir.name}.yaml", cfg)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.slow
def test_live_and_precomputed_references_zero3_and_zero0_and_a_resume_train_the_same_pairs(pref_data, tmp_path):
    """7 steps (the first two at lr 0: DeepSpeed's WarmupCosineLR), global batch 8 pairs: ZeRO-3 on 2 processes with the reference precomputed (one
    pass, stored in data.dir), the same with a live partitioned reference (losses within 1e-6),
    ZeRO-0 on 1 process reading the stored log-probs (loss relative difference <= 1e-5), the same
    with AutoTP over the 2 processes, and a resume from step 3 without the stored log-probs, which
    makes them again from the starting weights (the same, bitwise) and finishes with the
    uninterrupted run's losses, bitwise; the run exports."""
    pre = tmp_path / "pre"
    res = deepspeed_train(dpo_run(pref_data, pre, checkpoint={"every": 3, "keep": 0, "save_final": True}),
                          "zero3.json", timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    assert "reference log-probs: computing them for every pair with the policy before its first step" in res.out
    assert "data: preference, " in res.out
    stored = list((pref_data / "reference").glob("*.npz"))
    assert len(stored) == 1
    key = json.loads(stored[0].with_suffix(".json").read_text())["weights"]  # from scratch: what decides them
    assert key["seed"] == 7 and key["init"] == INIT_SCHEME and key["transformers"] and key["config"]
    a = metrics_by_step(pre)
    assert abs(a[1]["train/loss"] - LOG2) <= 1e-6  # the policy is still the reference
    # (rewards/accuracies counts margins above 0: at step 1 they are rounding, 0 or above by chance)
    assert abs(a[1]["rewards/margins"]) <= 1e-6
    assert a[7]["train/loss"] < a[1]["train/loss"] and a[7]["rewards/margins"] > 0
    assert 0 <= a[7]["eval/rewards/accuracies"] <= 1 and "eval/loss" in a[7]

    live = tmp_path / "live"
    res = deepspeed_train(dpo_run(pref_data, live, dpo={"reference": "live"}), "zero3.json", timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    assert "reference policy: a frozen copy of the starting model, partitioned over 2 ranks (ZeRO-3)" in res.out
    b = metrics_by_step(live)
    # The rewards are beta x differences of log-probs summed over a response (a hundred nats or more, whose
    # float32 ulp is ~1e-5), and the stored ones are computed in other batches than the live ones: 5e-5 is a few
    # ulps of them (an AMD EPYC's AVX2 kernels differ by 1.1e-6 at step 6; 1.8e-5 at step 4 once the chat
    # template's markers became one token each); a wrong reference is off by 1e-2 or more. The loss, -log sigmoid
    # of the margin, moves less than the margin does (its slope is below 1).
    for s in range(1, 8):
        for key, tol in (("train/loss", 5e-5), ("rewards/chosen", 5e-5), ("rewards/rejected", 5e-5),
                         ("rewards/margins", 5e-5)):
            assert abs(b[s][key] - a[s][key]) <= tol, (s, key, b[s][key], a[s][key])
    assert abs(b[7]["eval/loss"] - a[7]["eval/loss"]) <= 5e-5

    one = tmp_path / "one"
    res = deepspeed_train(dpo_run(pref_data, one), "zero0.json", nproc=1, timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    assert f"reference log-probs: read from {stored[0]}" in res.out
    c = metrics_by_step(one)
    assert all(rel(c[s]["train/loss"], a[s]["train/loss"]) <= 1e-5 for s in range(1, 8)), (c, a)

    tp = tmp_path / "tp"  # AutoTP: both ranks one tensor-parallel group, reading the stored log-probs
    res = deepspeed_train(dpo_run(pref_data, tp, parallel={"tensor": 2}), "zero1.json", timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    assert "reference log-probs: read from" in res.out
    t = metrics_by_step(tp)
    assert all(rel(t[s]["train/loss"], c[s]["train/loss"]) <= 1e-5 for s in range(1, 8)), (t, c)

    resumed = tmp_path / "resumed"  # on a node without the stored log-probs: made again from the starting weights
    stored[0].rename(tmp_path / "aside.npz")
    res = deepspeed_train(dpo_run(pref_data, resumed, checkpoint={
        "resume": str(pre / "checkpoints" / "step_00000003"), "save_final": True, "export_final": True}),
        "zero3.json", timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    assert ("reference log-probs: computing them for every pair with a frozen copy of the starting model, "
            "partitioned over 2 ranks (ZeRO-3)") in res.out
    with np.load(stored[0]) as again, np.load(tmp_path / "aside.npz") as first:
        assert all(np.array_equal(again[k], first[k], equal_nan=True) for k in ("train", "val"))
    d = metrics_by_step(resumed)
    assert sorted(d) == [4, 5, 6, 7] and all(d[s]["train/loss"] == a[s]["train/loss"] for s in range(4, 8))
    results = json.loads((resumed / "results.json").read_text())

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(results["export"])
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(pref_data / "tokenizer"))


@pytest.mark.slow
def test_dpo_under_expert_parallelism_trains_as_one_process_with_every_expert_does(pref_data, tmp_path):
    """A tiny Qwen3-MoE, its experts split over 2 ranks (parallel.expert 2, AutoEP, ZeRO-2) with a live
    reference (a second AutoEP engine), against 1 process holding every expert with the reference
    precomputed: the same losses (1e-5) and gradient norms (1e-4) at every step."""
    from test_parity import MOE_MODEL

    moe = {"config": dict(MOE_MODEL)}
    res = deepspeed_train(dpo_run(pref_data, tmp_path / "ep2", model=moe, parallel={"expert": 2},
                                  dpo={"reference": "live"}), "zero2.json", timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    assert "experts split over 2 of the data ranks" in res.out and "reference policy: a frozen copy" in res.out
    res = deepspeed_train(dpo_run(pref_data, tmp_path / "one", model=moe), "zero0.json", nproc=1, timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    ep, one = metrics_by_step(tmp_path / "ep2"), metrics_by_step(tmp_path / "one")
    assert sorted(ep) == sorted(one) == list(range(1, 8)) and one[7]["train/loss"] < one[1]["train/loss"]
    for s in one:
        assert rel(ep[s]["train/loss"], one[s]["train/loss"]) <= 1e-5, (s, ep[s], one[s])
        assert rel(ep[s]["optim/grad_norm"], one[s]["optim/grad_norm"]) <= 1e-4, (s, ep[s], one[s])


@pytest.fixture(scope="module")
def pref_base(pref_data, tmp_path_factory) -> Path:
    """A tiny Llama with the preference data's tokenizer (a model.path for LoRA)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("pref_base")
    tok = AutoTokenizer.from_pretrained(pref_data / "tokenizer")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY_MODEL, "vocab_size": len(tok)})).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.slow
def test_lora_prefers_against_its_base_live_and_precomputed(pref_data, pref_base, tmp_path):
    """LoRA on a model.path: the reference is the base with the adapters off, live under ZeRO-3 on
    2 processes and precomputed under ZeRO-1 on 1 (the same losses within 1e-5); an adapter export."""
    lora = {"path": str(pref_base), "config": {}, "dtype": "fp32", "lora": {"rank": 8, "alpha": 16}}
    runs, said = {}, {}
    for name, ds_config, nproc, reference in (("live", "zero3.json", 2, "live"), ("pre", "zero1.json", 1, "precomputed")):
        res = deepspeed_train(dpo_run(pref_data, tmp_path / name, model=lora, dpo={"reference": reference},
                                      optim={"lr": 2e-2, "warmup_steps": 0, "weight_decay": 0.0},
                                      checkpoint={"save_final": True}), ds_config, nproc=nproc, timeout=300)
        assert res.returncode == 0, res.out[-3000:]
        runs[name], said[name] = metrics_by_step(tmp_path / name), res.out
        assert abs(runs[name][1]["train/loss"] - LOG2) <= 1e-6  # adapters start at zero: the policy is its base
    assert "reference policy: the base model (the policy with its LoRA adapters off)" in said["live"]
    assert "computing them for every pair with the policy before its first step" in said["pre"]
    assert all(rel(runs["pre"][s]["train/loss"], runs["live"][s]["train/loss"]) <= 1e-5 for s in range(1, 8))
    assert runs["live"][7]["rewards/margins"] > 0 and runs["live"][7]["train/loss"] < LOG2
    from ds_train.checkpoint.lora_export import export_lora  # in this process (the command: test_lora.py)

    export_lora(tmp_path / "live", tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_the_memory_plan_counts_a_pair_as_two_sequences():
    from transformers import AutoConfig

    from ds_train.plan.memory import model_shape
    from ds_train.plan.planner import Target, plan_rows

    hf = AutoConfig.for_model(**{**TINY_MODEL, "vocab_size": 512})

    def activations(fmt: str, micro: int) -> list[float]:
        cfg = build_config({"model": {"config": dict(TINY_MODEL)}, "data": {"format": fmt},
                            "train": {"micro_batch_size": micro, "global_batch_size": 16}})
        rows = plan_rows(model_shape(hf, cfg.model.lora), cfg, {"stage": 2}, Target(1, 2, 80.0), "bf16")
        return [r["activations_gib"] for r in rows]

    assert activations("preference", 4) == activations("sft", 8) != activations("sft", 4)
