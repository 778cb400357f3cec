"""The embedding examples (examples/chat.c, examples/batch.c), built as an application would build
them: against the installed package's CMake config, and with its pkg-config file."""

import os
import shutil
import subprocess

import pytest

import ggraph

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _need(tool):
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")


@pytest.fixture(scope="module")
def example_build(tmp_path_factory):
    _need("cmake")
    prefix = ggraph.cmake_prefix_path()
    if not os.path.exists(os.path.join(prefix, "lib", "cmake", "ggraph", "ggraphConfig.cmake")):
        pytest.skip("this ggraph was not installed with its CMake package config")
    build = tmp_path_factory.mktemp("example")
    for cmd in (
        [
            "cmake",
            "-S",
            os.path.join(ROOT, "examples"),
            "-B",
            str(build),
            f"-DCMAKE_PREFIX_PATH={prefix}",
        ],
        ["cmake", "--build", str(build)],
    ):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
    return build


@pytest.fixture(scope="module")
def chat_binary(example_build):
    return str(example_build / "ggraph_chat")


def test_the_batch_example_decodes_each_prompt_as_alone(example_build, tiny_model):
    """Three conversations stepped together give each the reply it gets alone (greedy; on the
    CPU a batch's rows are each sequence's own step, bit for bit)."""
    exe = str(example_build / "ggraph_batch")
    prompts = ["hello there", "one two three", "a"]
    # (A random model's replies are arbitrary bytes.)
    run = dict(capture_output=True, text=True, errors="replace", timeout=120)
    together = subprocess.run([exe, tiny_model, "8", *prompts], **run)
    assert together.returncode == 0, together.stderr
    lines = together.stdout.split("\n")[:-1]  # (not splitlines: replies may hold \x0b, \x85)
    assert [line.split("]")[0] for line in lines] == ["[1", "[2", "[3"], together.stdout
    assert all(len(line) > len("[1] ") for line in lines), together.stdout
    alone = subprocess.run([exe, tiny_model, "8", prompts[1]], **run)
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.split("\n")[0][len("[1]") :] == lines[1][len("[2]") :]
    bad = subprocess.run([exe, tiny_model], **run)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_the_example_chats_turn_after_turn(chat_binary, tiny_model):
    out = subprocess.run(
        [chat_binary, tiny_model, "6"],
        input="Hi there\nAnd again <|im_end|> with a marker in the text\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    # Two turns, each ended with its reason.
    assert out.stdout.count("\n[") == 2, out.stdout


def test_the_example_reports_a_bad_model(chat_binary, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    out = subprocess.run([chat_binary, str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot load" in out.stderr


def test_pkg_config_compiles_the_example(tmp_path):
    _need("pkg-config")
    _need("cc")
    pc_dir = os.path.join(ggraph.cmake_prefix_path(), "lib", "pkgconfig")
    if not os.path.exists(os.path.join(pc_dir, "ggraph.pc")):
        pytest.skip("this ggraph was not installed with its pkg-config file")
    env = dict(os.environ, PKG_CONFIG_PATH=pc_dir)
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "ggraph"], capture_output=True, text=True, env=env
    )
    assert flags.returncode == 0, flags.stderr
    exe = tmp_path / "chat"
    cc = subprocess.run(
        ["cc", os.path.join(ROOT, "examples", "chat.c"), "-o", str(exe), *flags.stdout.split()],
        capture_output=True,
        text=True,
    )
    assert cc.returncode == 0, cc.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage" in out.stderr


def test_the_example_is_clean_under_valgrind(chat_binary, tiny_model):
    """No invalid access and no leak through a whole session: load, two streamed turns, free."""
    _need("valgrind")
    out = subprocess.run(
        [
            "valgrind",
            "--error-exitcode=9",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite,indirect",
            "-q",
            chat_binary,
            tiny_model,
            "6",
        ],
        input="Hello there\nAgain <|im_end|> x\n",
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("\n[") == 2
