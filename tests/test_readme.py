"""The README says what the code does and what the committed results hold: its usage code
runs, its settings table is knnconv.context's, its commands and paths exist, and its
performance figures are those of the committed result files."""

from __future__ import annotations

import dataclasses
import json
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


def test_fovi_install_is_the_one_the_tests_run():
    """The README's fovi install is run_tests.sh's: the fovi extra first, then fovi and timm
    at the same pins without their own requirements (pip's own --quiet aside)."""
    commands = re.findall(r"`(python3 -m pip install [^`]+)`", section("Usage"))
    extra, fovi = [command for command in commands if "fovi" in command]
    assert '".[fovi]"' in extra and "--no-deps" in fovi
    script = (ROOT / "scripts" / "run_tests.sh").read_text().replace(" --quiet", "")
    assert fovi in script
    assert script.index('.[dev,fovi]"') < script.index(fovi)


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


def test_generated_figures_are_the_committed_results():
    """Every performance figure sits in a block scripts/readme_tables.py generates from the
    committed result files, and the README holds exactly what it generates."""
    generated = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_tables.py")],
                               check=True, capture_output=True, text=True, cwd=ROOT).stdout
    blocks = re.findall(r"<!-- generated: ([\w-]+) -->\n.*?<!-- end: \1 -->", generated, re.S)
    assert blocks == ["whole-models", "latest-models", "per-layer", "latest-layers",
                      "neighbourhood"]
    for block in re.findall(r"<!-- generated: [\w-]+ -->\n.*?<!-- end: [\w-]+ -->", generated,
                            re.S):
        assert block in README, block.splitlines()[0]


def test_the_generated_figures_follow_the_files(tmp_path, monkeypatch):
    """The generator reads the result files: a changed figure changes its output."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import readme_tables
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    before = readme_tables.neighbourhood()
    result = json.loads((RESULTS / "h200_neighbourhood.json").read_text())
    for row in result["rows"]:
        if row["backend"] == "cuda":
            row["median_ms"] /= 2
    (tmp_path / "h200_neighbourhood.json").write_text(json.dumps(result))
    pools = "h100_fovi_pools_choices.json"
    (tmp_path / pools).write_text((RESULTS / pools).read_text())
    monkeypatch.setattr(readme_tables, "RESULTS", tmp_path)
    assert readme_tables.neighbourhood() != before


@pytest.mark.parametrize("name", ["h200.json", "h200_fovi_kernels.json", "h200_fovi_models.json",
                                  "h200_fovi_models_2026-12-04.json",
                                  "h200_fovi_models_2026-12-04_relu_fused.json",
                                  "h200_fovi_pools.json"])
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
