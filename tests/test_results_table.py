"""benchmarks/RESULTS.md's table of current figures is what the JSON files in
benchmarks/results/ say: every row's value is read back here from the file the row links to
(walking the figure's path by hand, not through the renderer), every file carries the run's
provenance (date, machine, load average, command), and the renderer's `--check` notices a file
that changed under the table."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import pytest

from benchmarks import results_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"


def table_rows(markdown: str) -> list[list[str]]:
    """The data rows of the table between the markers, split into cells (`\\|` kept in a cell)."""
    body = markdown[
        markdown.index("<!-- results-table:start") : markdown.index("<!-- results-table:end")
    ]
    lines = [line for line in body.splitlines() if line.startswith("| ")][1:]  # less the header
    rows = []
    for line in lines:
        cells = line.strip()[2:-2].replace("\\|", "\0").split(" | ")
        rows.append([c.replace("\0", "|") for c in cells])
    return rows


def figures_of(record: dict) -> list[tuple[str, list, str]]:
    if "figures" in record:
        return [(f["label"], f["path"], f["fmt"]) for f in record["figures"]]
    return [(f.label, list(f.path), f.fmt) for f in results_table.FIGURES[record["benchmark"]]]


def walk(value, path):
    for key in path:
        value = value[key]
    return value


def test_the_table_is_rendered_from_the_json_files():
    text = RESULTS_MD.read_text()
    assert results_table.table_in(text) == results_table.render(results_table.load_records()), (
        "benchmarks/RESULTS.md is stale: run python benchmarks/results_table.py"
    )


def test_every_row_reads_its_value_from_the_file_it_links():
    rows = table_rows(RESULTS_MD.read_text())
    files = sorted(RESULTS.glob("*.json"))
    assert rows and files
    linked = {row[-1] for row in rows}
    # every file has its rows, and every row names a file that exists
    assert linked == {f"[{p.name}](results/{p.name})" for p in files}
    for row in rows:
        label, value, date, machine, command, link = row
        record = json.loads((RESULTS / link[1 : link.index("]")]).read_text())
        texts = {"commit": (record.get("commit") or "unknown")[:7]}
        texts.update(
            (k, v)
            for k, v in record["result"].items()
            if isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))
        )
        (fig,) = [f for f in figures_of(record) if f[0].format(**texts) == label]
        assert value == fig[2].format(walk(record["result"], fig[1])), label
        assert date.startswith(str(record["date"])[:10])
        assert ("transcribed" in date) == ("transcribed_from" in record)
        assert command == f"`{record['command']}`"
        assert f"{record['machine']['cores']}-core" in machine


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_file_carries_the_runs_provenance(path):
    record = json.loads(path.read_text())
    assert record["benchmark"] in results_table.FIGURES
    datetime.date.fromisoformat(str(record["date"])[:10])
    machine = record["machine"]
    assert machine["cores"] >= 1 and machine["cpu"] and isinstance(machine["gpus"], list)
    load = record["load_avg"]
    assert (len(load["start"]) == 3 and len(load["end"]) == 3) if "start" in load else load["note"]
    assert record["command"].startswith("python ")
    assert isinstance(record["result"], dict)
    if "transcribed_from" in record:
        assert "HISTORY.md" in record["transcribed_from"]


def test_check_notices_a_changed_file_and_a_rerender_fixes_it(tmp_path):
    results, md = tmp_path / "results", tmp_path / "RESULTS.md"
    shutil.copytree(RESULTS, results)
    shutil.copy(RESULTS_MD, md)
    args = ["--results-md", str(md), "--results-dir", str(results)]
    assert results_table.main(["--check", *args]) == 0
    path = results / "vs_trl.json"
    record = json.loads(path.read_text())
    record["result"]["fixed"]["speedup_s_per_step"] = 9.87
    path.write_text(json.dumps(record))
    assert results_table.main(["--check", *args]) == 1
    assert results_table.main(args) == 0
    assert results_table.main(["--check", *args]) == 0
    assert "| 9.87x |" in md.read_text()


def test_a_file_of_an_unknown_benchmark_is_refused(tmp_path, capsys):
    results, md = tmp_path / "results", tmp_path / "RESULTS.md"
    results.mkdir()
    shutil.copy(RESULTS_MD, md)
    (results / "x.json").write_text(json.dumps({"benchmark": "nope", "result": {}}))
    assert results_table.main(["--results-md", str(md), "--results-dir", str(results)]) == 2
    assert "no figures for benchmark 'nope'" in capsys.readouterr().err


def test_a_figure_two_files_hold_with_the_same_value_is_shown_once():
    record = json.loads((RESULTS / "fp8_parity.json").read_text())
    again = json.loads(json.dumps(record))
    again["result"]["arms"]["bf16"]["mismatch_kl_mean"] *= 2  # another value: its own row
    rows = results_table.rows({"a.json": record, "b.json": record})
    assert len(rows) == len(results_table.rows({"a.json": record}))
    assert all(row[-1] == "[a.json](results/a.json)" for row in rows)
    label = "train/mismatch_kl, bf16 rollout (mean over steps, seeds)"
    rows = results_table.rows({"a.json": record, "b.json": again})
    assert [r[-1] for r in rows if r[0] == label] == [
        "[a.json](results/a.json)",
        "[b.json](results/b.json)",
    ]
    # another run whose value only rounds to the same cell is another row, not hidden
    bf16 = record["result"]["arms"]["bf16"]
    again["result"]["arms"]["bf16"]["mismatch_kl_mean"] = bf16["mismatch_kl_mean"] * (1 + 1e-9)
    rows = [r for r in results_table.rows({"a.json": record, "b.json": again}) if r[0] == label]
    assert [r[1] for r in rows] == [rows[0][1]] * 2
    assert [r[-1] for r in rows] == ["[a.json](results/a.json)", "[b.json](results/b.json)"]
