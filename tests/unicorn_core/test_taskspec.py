"""Task files: the shipped ones load; bad ones name the field and quote the value."""

from __future__ import annotations

from pathlib import Path

import pytest

from unicorn_core.errors import ConfigError
from unicorn_core.paths import etc_dir
from unicorn_core.taskspec import load_task_file, load_tasks

GOOD = """
name = "demo"
weight = 1.5
min_gpus = 8
max_gpus = 64

[model]
layers = 24
hidden = 2048
heads = 16
sequence = 2048
vocabulary = 50257
global_batch = 512
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "task.toml"
    path.write_text(text)
    return path


def test_good_file(tmp_path: Path) -> None:
    task = load_task_file(write(tmp_path, GOOD))
    assert (task.name, task.weight, task.min_gpus, task.max_gpus) == ("demo", 1.5, 8, 64)
    assert task.model.layers == 24 and task.model.ffn_hidden == 4 * 2048


def test_shipped_task_files_load() -> None:
    sizes = {
        p.stem: load_task_file(p).model.parameters for p in sorted((etc_dir() / "tasks").glob("gpt3-*.toml"))
    }
    assert set(sizes) == {"gpt3-1.3b", "gpt3-7b", "gpt3-13b", "gpt3-175b"}
    assert sizes["gpt3-1.3b"] < sizes["gpt3-7b"] < sizes["gpt3-13b"] < sizes["gpt3-175b"]
    counts = [len(load_tasks(etc_dir() / "tasks" / "cases" / f"case{c}.toml")) for c in range(1, 6)]
    assert counts == [6, 6, 5, 5, 5]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("weight = 1.5", "weight = 3.0", "weight must be between 0.5 and 2.0, got 3.0"),
        ("weight = 1.5", 'weight = "heavy"', "weight must be a number, got 'heavy'"),
        ("min_gpus = 8", "min_gpus = 0", "min_gpus must be a positive integer, got 0"),
        ("max_gpus = 64", "max_gpus = 4", "max_gpus 4 is below min_gpus 8"),
        ("layers = 24", "layers = 2.5", "model.layers must be a positive integer, got 2.5"),
        ("layers = 24\n", "", "model is missing required field\\(s\\) layers"),
        ("hidden = 2048", "hidden = 2050", "hidden 2050 is not divisible by heads 16"),
        ('name = "demo"', 'name = ""', "name must be a non-empty string"),
        ("weight = 1.5", "wieght = 1.5", "unknown task key\\(s\\) 'wieght'; valid keys: name, weight"),
        ("heads = 16", "heads = 16\nexperts = 8", "unknown model key\\(s\\) 'experts'; valid keys: layers"),
        ("[model]", "[modle]", "unknown task key\\(s\\) 'modle'"),
        ('name = "demo"', "", "name is required"),
        ("weight = 1.5", "weight = ", "task file .*: invalid TOML"),
    ],
)
def test_bad_files(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in GOOD
    with pytest.raises(ConfigError, match=message):
        load_task_file(write(tmp_path, GOOD.replace(old, new, 1)))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"task file .*absent\.toml.*: not found"):
        load_task_file(tmp_path / "absent.toml")


def test_task_list_names_entry_and_rejects_duplicates(tmp_path: Path) -> None:
    entry = GOOD.replace("[model]", "[task.model]")
    path = write(tmp_path, "[[task]]" + entry + "\n[[task]]" + entry)
    with pytest.raises(ConfigError, match="task name 'demo' appears more than once"):
        load_tasks(path)
    path = write(
        tmp_path, "[[task]]" + entry + "\n[[task]]" + entry.replace('"demo"', '"b"').replace("1.5", "9.0")
    )
    with pytest.raises(ConfigError, match=r"task\[1\]\.weight must be between"):
        load_tasks(path)
