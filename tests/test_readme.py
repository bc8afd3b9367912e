"""The README says what the code does and what the committed results hold: its usage code
runs, its settings table is knnconv.context's, its commands and paths exist, and its
performance figures are those of the committed result files."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from knnconv import context
from knnconv.tools import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "bench" / "results"


def section(title: str) -> str:
    """The README's text under a heading, up to the next heading of any level (a line that
    starts with '#' inside a code block is a comment, not a heading)."""
    lines, inside, in_code = [], False, False
    for line in README.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#+ ", line):
            if inside:
                break
            inside = line.split(" ", 1)[1] == title
            continue
        if inside:
            lines.append(line)
    assert lines, f"README has no section {title!r}"
    return "\n".join(lines) + "\n"


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def table_rows(text: str, header: str = "|") -> list[list[str]]:
    """The body rows of the Markdown table in ``text`` whose header line starts with
    ``header`` (by default the first table), cells stripped."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def shown(text: str) -> tuple[float, float]:
    """A figure as printed and half a unit of its last digit: what it may differ by."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return float(text), 0.5 * 10.0 ** -decimals + 1e-9


def assert_shows(text: str, value: float) -> None:
    figure, tolerance = shown(text)
    assert abs(figure - value) <= tolerance, f"README shows {text}, the file holds {value:.4g}"


def test_usage_code_runs_and_gives_the_sizes_its_comments_state():
    (usage,) = code_blocks(section("Usage"), "python")
    namespace: dict = {}
    exec(compile(usage, "README.md (Usage)", "exec"), namespace)
    sensor, level1, y = namespace["sensor"], namespace["level1"], namespace["y"]
    assert re.search(rf"# {len(sensor)} and {len(level1)} points", usage)
    assert f"# [8, 64, {len(level1)}]" in usage and tuple(y.shape) == (8, 64, len(level1))
    assert namespace["conv"].plan.v == 49 and "V = 7x7" in usage
    assert torch.isfinite(y).all()


def test_settings_table_is_the_contexts():
    rows = {row[0].strip("`"): row for row in table_rows(section("Settings"))}
    defaults = context.Settings()
    assert set(rows) == {field.name for field in dataclasses.fields(context.Settings)}
    for name, (_, variable, default, _) in rows.items():
        assert variable.strip("`") == context.ENVIRONMENT[name]
        if name in context.FLAGS:
            assert default == ("on" if getattr(defaults, name) else "off")
    assert rows["cache_dir"][2].strip("`") == "~/" + str(
        defaults.cache_dir.relative_to(Path.home()))
    assert defaults.cuda_include_dir is None and rows["cuda_include_dir"][2] == "searched"
    (snippet,) = code_blocks(section("Settings"), "python")
    compile(snippet, "README.md (Settings)", "exec")
    assert {"configure", "using"} <= set(re.findall(r"knnconv\.context\.(\w+)", snippet))
    assert all(hasattr(context, name) for name in ("configure", "using"))


def test_the_two_commands_are_the_scripts_ci_runs():
    (commands,) = code_blocks(section("The two commands"), "bash")
    scripts = re.findall(r"^bash (\S+)", commands, re.M)
    assert scripts == ["scripts/main_job.sh", "scripts/run_tests.sh"]
    assert all((ROOT / script).is_file() for script in scripts)
    assert "bash scripts/run_tests.sh" in (ROOT / ".ci" / "run").read_text()
    assert "knnconv demo" in (ROOT / "scripts" / "main_job.sh").read_text()


def test_commands_and_their_options_exist():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # the subcommand parsers
    text = section("Commands") + section("The two commands")
    for command, options in (("demo", "--epochs --device --out"),
                             ("bench", "--geometry --stems --out --model --compile")):
        assert f"knnconv {command}" in text
        known = {flag for action in commands[command]._actions for flag in action.option_strings}
        assert set(options.split()) <= known, f"knnconv {command}"
    assert {"run", "check"} <= set(commands)


def test_every_linked_or_named_repository_path_exists():
    linked = re.findall(r"\]\(((?:bench|scripts|examples|src)/[^)\s]+)\)", README)
    named = re.findall(r"`((?:bench|scripts|examples)/[\w./]+\.\w+)`", README)
    assert linked and named
    missing = [path for path in linked + named if not (ROOT / path).exists()]
    assert not missing


def whole_model_rows() -> dict[tuple, dict]:
    data = json.loads((RESULTS / "h200_fovi_models.json").read_text())
    return {(row["model"], row["path"], row["mode"], row["batch"]): row
            for row in data["rows"] if row["status"] == "ok"}


def test_whole_model_table_is_the_committed_run():
    rows = whole_model_rows()
    models, modes = {"ResNet-18": "resnet18", "AlexNet": "alexnet"}, {"eager": "eager",
                                                                      "CUDA graph": "graph"}
    paths = ("fovi", "accelerated", "accelerated+compile", "grid")
    table = table_rows(section("Performance"), "| model | B | mode")
    assert len(table) == 6
    for model, batch, mode, *cells in table:
        key = models[model], int(batch), modes[mode]
        fovi_ms = rows[(key[0], "fovi", key[2], key[1])]["median_ms"]
        for path, cell in zip(paths, cells, strict=True):
            if not cell:
                continue
            median = rows[(key[0], path, key[2], key[1])]["median_ms"]
            time, *speedup = re.fullmatch(r"([\d.]+) ms(?: \(([\d.]+)x\))?", cell).groups()
            assert_shows(time, median)
            if speedup and speedup[0]:
                assert_shows(speedup[0], fovi_ms / median)


def test_whole_model_sentences_are_the_committed_run():
    rows = whole_model_rows()
    text = " ".join(section("Performance").split())
    against_grid = re.search(r"costs ([\d.]+)x the grid network of the same pixels at "
                             r"B = 2048 and ([\d.]+)x at B = 512", text).groups()
    for batch, shown_ratio in zip((2048, 512), against_grid, strict=True):
        assert_shows(shown_ratio, rows[("resnet18", "accelerated", "graph", batch)]["median_ms"]
                     / rows[("resnet18", "grid", "graph", batch)]["median_ms"])
    for model, label in (("resnet18", "its peak memory is"), ("alexnet", "AlexNet's")):
        ratios = [row["peak_mib"] / rows[(model, "fovi", mode, batch)]["peak_mib"]
                  for (name, path, mode, batch), row in rows.items()
                  if name == model and path == "accelerated"]
        low, high = re.search(rf"{label} ([\d.]+)-([\d.]+)x", text).groups()
        assert_shows(low, min(ratios))
        assert_shows(high, max(ratios))


def profile_at(per_batch, batch: int) -> dict:
    """A path's GPU-time breakdown at ``batch``: the bench writes one per profiled batch (a
    list); the committed run, from before that, holds one (a dict)."""
    entries = per_batch if isinstance(per_batch, list) else [per_batch]
    (entry,) = [entry for entry in entries if entry["batch"] == batch]
    return entry


def test_whole_model_breakdown_is_the_committed_profile():
    breakdown = json.loads((RESULTS / "h200_fovi_models.json").read_text())["breakdown"]
    text = " ".join(section("Performance").split())
    batch = int(re.search(r"GPU time goes at B = (\d+)", text).group(1))
    resnet = profile_at(breakdown["resnet18"]["accelerated"], batch)
    for category, label in (("knn_conv", "KNN convolutions"), ("normalisation", "batch norm"),
                            ("knn_pool", "KNN pooling"), ("relayout_copy", "re-layouts and copies"),
                            ("other", "other")):
        assert_shows(re.search(rf"{label} ([\d.]+) ms", text).group(1),
                     resnet["ms_per_step"][category])
    alexnet = profile_at(breakdown["alexnet"]["accelerated"], batch)["ms_per_step"]
    conv, total = re.search(r"AlexNet's is (\d+) of (\d+) ms in its KNN convolutions",
                            text).groups()
    assert_shows(conv, alexnet["knn_conv"])
    assert_shows(total, sum(alexnet.values()))


def test_neighbourhood_speedups_are_the_committed_run():
    rows = json.loads((RESULTS / "h200_neighbourhood.json").read_text())["rows"]
    times = {(row["backend"], row["op"], row["batch"], row["mode"]): row["median_ms"]
             for row in rows}
    ratios = [times[("torch_compact", *key[1:])] / ms for key, ms in times.items()
              if key[0] == "cuda"]
    low, high = re.search(r"native kernels run ([\d.]+)-([\d.]+)x faster than the same layers "
                          r"in torch ops", " ".join(section("Performance").split())).groups()
    assert_shows(low, min(ratios))
    assert_shows(high, max(ratios))


def test_per_layer_headline_figures_are_the_committed_runs():
    anchor = json.loads((RESULTS / "h200_anchor.json").read_text())["summary"]
    bench = json.loads((RESULTS / "h200.json").read_text())
    table = {row[0]: row[1:] for row in table_rows(section("Performance"),
                                                   "| per layer, geometric mean")}

    def row(prefix: str) -> list[str]:
        (match,) = [cells for label, cells in table.items() if label.startswith(prefix)]
        return match

    fresh = row("speedup over fovi 2.4.0's kernels timed in the same run")
    assert_shows(fresh[0].rstrip("x"), anchor["train_fresh_speedup_geomean"])
    assert_shows(fresh[1].rstrip("x"), anchor["forward_fresh_speedup_geomean"])
    assert f"({anchor['cells']} cells; none slower in training, one forward)" in "".join(
        label for label in table if label.startswith("speedup over fovi 2.4.0's kernels"))
    assert anchor["train_fresh_cells_slower"] == 0 and anchor["forward_fresh_cells_slower"] == 1
    memory = row("peak memory of a training step")
    assert_shows(memory[0].rstrip("x"), anchor["peak_train_memory_ratio_geomean"])

    published = {entry["mode"]: entry for entry in bench["summary"][
        "train_speedup_vs_anchor_geomean"] if entry["backend"] == "cuda"}
    assert_shows(row("speedup over fovi 2.4.0's published")[0].rstrip("x"),
                 published["train"]["geomean"])

    cells = [r for r in bench["rows"] if r["backend"] == "cuda" and r["dtype"] == "float16"]
    by_mode = {mode: {(r["layer"], r["batch"]): r for r in cells if r["mode"] == mode}
               for mode in ("train", "forward")}
    large = [key for key, r in by_mode["train"].items() if r["floor_ms"] >= 0.1]
    floor_row = row("% of the roofline floor, large layers")
    train_pct = [by_mode["train"][key]["pct_of_floor"] for key in large]
    geomean_text, low, high = re.fullmatch(r"([\d.]+)% \(([\d.]+)-([\d.]+)%\)",
                                           floor_row[0]).groups()
    assert_shows(geomean_text, geomean(train_pct))
    assert_shows(low, min(train_pct))
    assert_shows(high, max(train_pct))
    assert_shows(floor_row[1].rstrip("%"),
                 geomean(by_mode["forward"][key]["pct_of_floor"] for key in large))
    assert f"(training floor >= 0.1 ms, {len(large)} cells)" in "".join(table)


@pytest.mark.parametrize("name", ["h200.json", "h200_anchor.json", "h200_fovi_models.json"])
def test_result_files_name_the_gpu_they_ran_on(name):
    assert "H200" in json.loads((RESULTS / name).read_text())["device"]


def test_linked_full_table_is_generated_from_the_committed_run():
    generated = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "results_table.py"),
         "bench/results/h200.json"], check=True, capture_output=True, text=True, cwd=ROOT)
    assert "(bench/RESULTS.md)" in README
    assert generated.stdout == (ROOT / "bench" / "RESULTS.md").read_text()


def test_layout_names_files_that_exist():
    (tree,) = code_blocks(section("Layout"), "")
    package = ROOT / "src" / "knnconv"
    names = set(re.findall(r"\b([\w*]+\.(?:py|json|cu|cuh|sh|md))\b", tree))
    assert len(names) > 20
    present = {path.name for path in ROOT.rglob("*") if ".git" not in path.parts}
    missing = sorted(name for name in names if "*" not in name and name not in present)
    assert not missing
    modules = {path.stem for path in package.rglob("*.py")}
    for listed in re.findall(r"^  (\w+)/", tree, re.M):  # the package's sub-packages
        assert (package / listed).is_dir() or listed in modules
