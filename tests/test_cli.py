"""Bad input on the command line: one clear line naming the file, key or value, a non-zero exit,
no traceback, and nothing in the run directory written or overwritten."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, ds_train, tiny_config, write_config
from ds_train.__main__ import main

ZERO0 = str(ROOT / "ds_configs" / "zero0.json")


@pytest.fixture
def run_dir(tmp_path):
    """An output_dir holding an earlier run's file, which a failed start must leave untouched."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    return out


def expect_error(capsys, run_dir, argv, *needles):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert err.startswith("ds-train: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]
    assert run_dir.joinpath("metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    return err


def test_missing_config_file(capsys, run_dir, tmp_path):
    expect_error(capsys, run_dir, ["train", "--config", str(tmp_path / "nope.yaml"), "--ds-config", ZERO0],
                 "nope.yaml", "not found")


def test_invalid_yaml_names_the_line(capsys, run_dir, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("output_dir: x\ntrain:\n  max_steps: [1, 2\n")
    expect_error(capsys, run_dir, ["train", "--config", str(bad), "--ds-config", ZERO0],
                 "bad.yaml", "invalid YAML", "line ")


def test_unknown_override_suggests_the_key(capsys, run_dir, tiny_data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, run_dir))
    expect_error(capsys, run_dir, ["train", "--config", str(cfg), "--ds-config", ZERO0,
                                   "train.max_step=3"], "train.max_step", "did you mean 'train.max_steps'")


def test_invalid_ds_json_names_the_line(capsys, run_dir, tiny_data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, run_dir))
    ds = tmp_path / "ds.json"
    ds.write_text('{\n  "zero_optimization": {"stage": 2,}\n}\n')
    expect_error(capsys, run_dir, ["train", "--config", str(cfg), "--ds-config", str(ds)],
                 "ds.json", "invalid JSON at line 2")


def test_unknown_ds_key_is_named(capsys, run_dir, tiny_data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, run_dir))
    ds = tmp_path / "ds.json"
    template = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    template["zero_optimization"]["overlap_com"] = True
    ds.write_text(json.dumps(template))
    expect_error(capsys, run_dir, ["train", "--config", str(cfg), "--ds-config", str(ds)],
                 "zero_optimization.overlap_com", "unknown key")


def test_ds_value_contradicting_the_run_config(capsys, run_dir, tiny_data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, run_dir))
    ds = tmp_path / "ds.json"
    template = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    template["train_batch_size"] = 64
    ds.write_text(json.dumps(template))
    expect_error(capsys, run_dir, ["train", "--config", str(cfg), "--ds-config", str(ds)],
                 "train_batch_size=64", "train.global_batch_size=8")


def test_batch_math_names_the_numbers_and_valid_choices(capsys, run_dir, tiny_data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, run_dir))
    expect_error(capsys, run_dir, ["train", "--config", str(cfg), "--ds-config", ZERO0,
                                   "train.global_batch_size=10", "train.micro_batch_size=4"],
                 "train.global_batch_size=10", "train.micro_batch_size=4", "world size 1",
                 "train.global_batch_size=8 or 12")


def test_a_parallel_layout_that_does_not_fit_is_one_line_naming_the_numbers_and_the_choices(
        capsys, run_dir, tiny_data, tmp_path):
    """The world size (a run of one process), the model's heads (the plan for a target cluster, and
    `ds-train launch`'s check of a hostfile's world), AutoTP's refusals (ZeRO-3, a model type without a
    tensor-parallel plan): each one line before anything is written."""
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, run_dir))
    expect_error(capsys, run_dir, ["train", "--config", str(cfg), "--ds-config", ZERO0, "parallel.sequence=2"],
                 "parallel.sequence=2 x parallel.tensor=1 = 2 does not divide the world size 1",
                 "choose sizes whose product is 1, or launch a multiple of 2 ranks")
    expect_error(capsys, run_dir, ["estimate", "--config", str(cfg), "--ds-config", ZERO0, "--nodes", "1",
                                   "--gpus-per-node", "3", "parallel.tensor=3"],
                 "parallel.tensor=3 does not divide the model's 4 attention heads; choose 1, 2 or 4")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.2 slots=3\n")
    expect_error(capsys, run_dir, ["launch", "--hostfile", str(hostfile), "--check", "--", "train", "--config",
                                   str(cfg), "--ds-config", ZERO0, "parallel.sequence=3"],
                 "train.seq_len=64 is not divisible by parallel.sequence=3")  # what each rank says first
    expect_error(capsys, run_dir, ["launch", "--hostfile", str(hostfile), "--check", "--", "train", "--config",
                                   str(cfg), "--ds-config", ZERO0, "parallel.sequence=3", "train.seq_len=66"],
                 "parallel.sequence=3 does not divide the model's 4 attention heads; choose 1, 2 or 4")
    expect_error(capsys, run_dir, ["estimate", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero3.json"),
                                   "--nodes", "1", "--gpus-per-node", "4", "parallel.tensor=2"],
                 "parallel.tensor=2 with ZeRO-3: ds_train trains AutoTP with ZeRO 0-2")
    expect_error(capsys, run_dir, ["launch", "--hostfile", str(hostfile), "--check", "--", "train", "--config",
                                   str(cfg), "--ds-config", ZERO0, "parallel.tensor=3"],
                 "parallel.tensor=3 does not divide the model's 4 attention heads; choose 1, 2 or 4")
    gpt2 = write_config(tmp_path / "gpt2.yaml", tiny_config(tiny_data, run_dir, model={
        "config": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}}))
    expect_error(capsys, run_dir, ["estimate", "--config", str(gpt2), "--ds-config", ZERO0, "--nodes", "1",
                                   "--gpus-per-node", "2", "parallel.tensor=2"],
                 "parallel.tensor=2: model type 'gpt2' has no Hugging Face tensor-parallel plan")
    expect_error(capsys, run_dir, ["train", "--config", str(cfg), "--ds-config", ZERO0, "parallel.sequence=2",
                                   "train.seq_len=63", "model.attn_implementation=eager"],
                 "train.seq_len=63 is not divisible by parallel.sequence=2 (each sequence rank holds seq_len / 2 "
                 "positions); choose 62 or 64", "model.attn_implementation='eager' cannot run under "
                 "parallel.sequence=2")


def test_missing_data(capsys, run_dir, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "no_data", run_dir))
    expect_error(capsys, run_dir, ["train", "--config", str(cfg), "--ds-config", ZERO0],
                 "no_data", "meta.json", "ds-train prepare")


def test_token_ids_beyond_the_vocab(capsys, run_dir, tiny_data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, run_dir))
    expect_error(capsys, run_dir, ["train", "--config", str(cfg), "--ds-config", ZERO0,
                                   "model.config.vocab_size=100"], "token id 511", "vocab_size 100")


def test_seq_len_beyond_max_positions(capsys, run_dir, tiny_data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, run_dir))
    expect_error(capsys, run_dir, ["train", "--config", str(cfg), "--ds-config", ZERO0,
                                   "train.seq_len=256"], "train.seq_len=256", "max_position_embeddings=128")


def test_bad_input_exits_non_zero_in_a_real_process_without_traceback(tmp_path):
    res = ds_train("train", "--config", str(tmp_path / "missing.yaml"), "--ds-config", ZERO0, timeout=120)
    assert res.returncode == 2
    assert "ds-train: error: " in res.out and "Traceback" not in res.out


def test_debug_shows_the_traceback(tmp_path):
    res = ds_train("--debug", "train", "--config", str(tmp_path / "missing.yaml"), "--ds-config", ZERO0,
                   timeout=120)
    assert res.returncode != 0 and "Traceback" in res.out and "UserError" in res.out


@pytest.mark.parametrize("argv, needle", [
    (["train", "--ds-config", "x"], "train needs --config and --ds-config (see `ds-train train --help`)"),
    (["train", "--config", "c", "--ds-config", "d", "--bogus"], "unrecognized arguments: --bogus"),
    (["trian"], "invalid choice: 'trian'"),
    (["convert", "--to", "zip", "x"], "argument --to: invalid choice: 'zip' (choose from 'universal') (see "
                                      "`ds-train convert --help`)"),
    (["slurm", "--nodes", "x", "--gpus-per-node", "1", "--", "train"], "argument --nodes: invalid int value: 'x'"),
])
def test_command_line_mistakes_are_one_line_too(capsys, run_dir, argv, needle):
    """argparse's own errors: one `ds-train: error:` line pointing at --help, no usage block."""
    expect_error(capsys, run_dir, argv, needle)


def test_a_failed_run_ends_with_the_line_that_says_how_the_doctors_pointer_before_it(capsys):
    """What Run.__exit__ attaches (the doctor's pointer, then on the reporting rank the job's verdict)
    goes around the error line so that the output closes with how the command ended."""
    from ds_train.__main__ import _report
    from ds_train.errors import NonFiniteStop, OutOfMemory, PeerFailed
    from ds_train.observe.reports import doctor_hint

    hint = doctor_hint("runs/x")
    stop = NonFiniteStop("step 5", 2)
    peer = PeerFailed("rank 1 on node 0 (vm) failed first, in phase data of step 3: RuntimeError: boom", say=True)
    oom = OutOfMemory("out of GPU memory: the plan ...\nthe device said: CUDA out of memory.")
    for e in (stop, peer, oom):
        e.add_note(hint)
    oom.add_note(f"ds-train: error: {peer}")
    assert [_report(e) for e in (stop, peer, oom)] == [3, 1, 4]
    assert capsys.readouterr().err.splitlines() == [
        hint, f"ds-train: error: {stop}",
        hint, f"ds-train: error: {peer}",
        hint, "ds-train: error: out of GPU memory: the plan ...", "the device said: CUDA out of memory.",
        f"ds-train: error: {peer}"]


def test_debug_goes_before_or_after_the_command(tmp_path):
    res = ds_train("train", "--debug", "--config", str(tmp_path / "missing.yaml"), "--ds-config", ZERO0, timeout=120)
    assert res.returncode == 2 and "Traceback" in res.out and "UserError" in res.out


def test_help_config_lists_every_key(capsys):
    from ds_train.config.file import all_keys

    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert all(key in out for key in all_keys())


def test_prepare_command(tmp_path, capsys):
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.txt").write_text(f"document {i} " * 200)
    assert main(["prepare", str(src), "--out", str(tmp_path / "out"), "--vocab-size", "300",
                 "--val-fraction", "0.3"]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert 257 <= meta["vocab_size"] <= 300 and meta["train_tokens"] > 0 and meta["val_tokens"] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"prepare: wrote {tmp_path / 'out'}/train.bin ({meta['train_tokens']:,} tokens), val.bin "
        f"({meta['val_tokens']:,} tokens), meta.json; vocab {meta['vocab_size']} ({meta['dtype']}); tokenizer "
        f"{tmp_path / 'out' / 'tokenizer'}")


def test_prepare_sft_from_the_command_line_and_its_bad_input(tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": f"q{i} " * 5, "completion": f"a{i} " * 5}) + "\n"
                            for i in range(30)))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    assert main(["prepare", str(chat), "--out", str(tmp_path / "out"), "--vocab-size", "300", "--format", "sft",
                 "--chat-template", str(template), "--workers", "1"]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["format"] == "sft" and 0 < meta["train_targets"] < meta["train_tokens"]
    assert (tmp_path / "out" / "tokenizer" / "chat_template.jinja").read_text() == template.read_text()
    for args, said in ((["--format", "sft"], "data.chat_template: the tokenizer has no chat template; set"),
                       (["--workers", "-1"], "prepare: --workers -1: give 0 (one per core) or more"),
                       (["--format", "sft", "--chat-template", str(tmp_path / "none.jinja")],
                        f"prepare: --chat-template '{tmp_path / 'none.jinja'}' cannot be read")):
        capsys.readouterr()
        assert main(["prepare", str(chat), "--out", str(tmp_path / "bad"), "--vocab-size", "300", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"ds-train: error: {said}"), err
        assert not (tmp_path / "bad").exists()


def test_the_collector_is_off_through_the_start_up_and_back_on_for_a_command_that_builds_no_run(
        monkeypatch, tmp_path):
    """cli() turns the garbage collector off before anything is imported (a quarter of a rank's
    start-up CPU is the collector scanning torch's, DeepSpeed's and transformers' objects); main()
    turns it back on before a command that builds no run, ensure_prepared before it streams a corpus
    (start.build_run once the run is built: every launch test runs through it)."""
    import gc

    import ds_train.__main__ as entry
    from ds_train.config import DataConfig
    from ds_train.data.prepare import ensure_prepared

    seen = []
    monkeypatch.setattr(entry, "main", lambda: seen.append(gc.isenabled()) or 0)
    try:
        with pytest.raises(SystemExit) as exit_:
            entry.cli()
        assert exit_.value.code == 0 and seen == [False]
        gc.disable()
        assert main(["doctor", str(tmp_path)]) == 2 and gc.isenabled()  # not a run directory: one line
        gc.disable()
        assert main(["train", "--config", str(tmp_path / "missing.yaml"), "--ds-config", "x.json"]) == 2
        assert not gc.isenabled()  # a run command: build_run turns it on (this one failed before it)
        (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 200)
        ensure_prepared(DataConfig(dir=str(tmp_path / "data"), sources=[str(tmp_path / "corpus.txt")], vocab_size=300))
        assert gc.isenabled()  # a rank that prepares its data streams the corpus with the collector on
    finally:
        gc.unfreeze()
        gc.enable()
    assert entry.BUILDS_A_RUN == ("train", "ript", "dry-run", "parity-worker")
