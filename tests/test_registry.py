"""The kernel registry (mlemlib.registry): names, auto rules, the schema, the CLI, the workflow check,
and the package's import structure (no import circle in mlemlib)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from mlemlib import bench, registry
from mlemlib.cli import main
from mlemlib.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- auto and selectors
@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        # one GPU: A^T given and both fit -> csr_vector on A^T, deterministic
        ({"transpose_available": True, "fits": True}, ("csr_vector", "csr_vector", True, True)),
        # A^T does not fit, or none given -> the notrans selector, not deterministic
        ({"transpose_available": True, "fits": False}, ("csr_vector", "notrans", False, False)),
        ({"transpose_available": False, "fits": True}, ("csr_vector", "notrans", False, False)),
        # N GPUs, same rule with the same facts
        ({"gpus": 2, "layout": "local", "transpose_available": True}, ("csr_vector", "csr_vector", True, True)),
        ({"gpus": 4, "layout": "thesis", "transpose_available": True}, ("csr_vector", "csr_vector", True, True)),
        ({"gpus": 2, "layout": "local", "transpose_available": False}, ("csr_vector", "notrans", False, False)),
    ],
)
def test_cuda_auto(facts, expected):
    c = registry.resolve("cuda", "auto", "auto", **facts)
    assert (c.fp, c.bp, c.needs_transpose, c.deterministic) == expected


def test_cuda_named_pairs():
    c = registry.resolve("cuda", "merge", "notrans")
    assert (c.fp, c.bp, c.deterministic) == ("merge", "notrans", False)
    c = registry.resolve("cuda", "csr_vector", "scatter", transpose_available=True)
    assert (c.bp, c.needs_transpose, c.deterministic) == ("scatter", False, False)
    c = registry.resolve("cuda", "cusparse", "cusparse", transpose_available=False)
    assert c.needs_transpose and not c.deterministic  # cuSPARSE's SpMV is not bit-reproducible
    assert c.settle("csr_vector").bp == "csr_vector"
    assert registry.resolve("cuda", "csr_vector", "notrans").settle("scatter_smem").deterministic is False


@pytest.mark.parametrize(
    ("threads", "transpose", "expected"),
    [(1, True, ("scipy", "scipy")), (4, True, ("numba", "numba")), (4, False, ("numba", "numba")), (1, False, ("scipy", "numba"))],
)
def test_cpu_auto(threads, transpose, expected):
    c = registry.resolve("cpu", None, "auto", transpose_available=transpose, threads=threads)
    assert (c.fp, c.bp) == expected
    assert c.deterministic  # every cpu kernel is
    assert c.needs_transpose is transpose


def test_choose_notrans():
    assert registry.choose_notrans(1.0) == "scatter_smem"
    assert registry.choose_notrans(registry.SMEM_LOCAL_MIN) == "scatter_smem"
    assert registry.choose_notrans(0.49) == "scatter"
    # whatever it picks is a kernel the registry has, on every GPU count
    for frac in (1.0, 0.0):
        for gpus in (1, 2, 4):
            name = registry.choose_notrans(frac)
            assert name in registry.names("cuda", "back_notrans", gpus=gpus, layout="local" if gpus > 1 else None)


def test_every_kernel_binds_a_launcher_that_exists():
    """Each entry names its launcher; the registry imports it (no GPU needed) with the kernel's name bound."""

    for k in registry.KERNELS:
        fn = registry.launcher(k)
        assert callable(fn.func) and fn.keywords == {"kernel": k.name}, k
        assert fn.func.__module__ == "mlemlib.backends." + k.launcher.split(":")[0]
    with pytest.raises(ConfigError, match="no launcher"):
        registry.launcher(dataclasses.replace(registry.get("cpu", "forward", "numba"), launcher=""))


def test_row_forward_is_autos_forward_of_each_format():
    assert registry.row_forward("csr").name == "csr_vector"
    for fmt in ("compressed", "compressed-f16", "compressed-u16"):
        k = registry.row_forward(fmt)
        assert k.name == "delta_vector" and k.op == "forward" and fmt in k.formats


def test_every_whole_iteration_kernel_runs_in_the_local_layout():
    """mlem kernels lists the one passes, the chunked one included, on N GPUs (each GPU its row block)."""
    for k in registry.KERNELS:
        if k.backend == "cuda" and k.op == "iteration":
            assert "local" in k.layouts, k.name
            assert registry.check("bp", k.name, "cuda", gpus=4, layout="local") == k.name
    row = [r for r in registry.table().splitlines() if r.startswith("| cuda | iteration | onepass_chunked |")]
    assert len(row) == 1 and "| local |" in row[0]
    # every cuda kernel runs in the local layout; one that would not gets its reason in the table
    assert [k.name for k in registry.KERNELS if k.backend == "cuda" and "local" not in k.layouts] == []
    assert "one GPU only:" not in registry.table()


def test_the_same_bits_on_every_gpu_count_are_the_fixed_point_kernels():
    """Only the kernels that sum bp as 64-bit fixed point (their launchers take the add limits) claim the same bits
    on every GPU count, and mlem kernels says so; the float-summing deterministic ones (csr_vector) do not."""
    claim = {k.name for k in registry.KERNELS if k.any_gpu_count}
    assert claim == {"onepass_fixed", "onepass_chunked"}
    assert all(k.deterministic and k.limits for k in registry.KERNELS if k.any_gpu_count)
    table = registry.table().splitlines()
    for name in ("onepass_fixed", "onepass_chunked"):
        assert any(r.startswith(f"| cuda | iteration | {name} |") and "| yes, every GPU count |" in r for r in table)
    row = next(r for r in table if r.startswith("| cuda | back | csr_vector |"))
    assert "| yes |" in row and "every GPU count" not in row


def test_the_table_says_why_a_kernel_runs_on_one_gpu_only(monkeypatch):
    lone = dataclasses.replace(registry.get("cuda", "back_notrans", "cusparse_notrans"), layouts=(),
                               summary="cuSPARSE's transposed product: one GPU (a reason)")
    monkeypatch.setattr(registry, "KERNELS", (*registry.KERNELS, lone))
    assert f"- {lone.name} ({lone.op}): {lone.summary}" in registry.table().split("one GPU only:")[1]


def test_no_kernel_name_is_compared_as_a_string_in_the_backends():
    """The backends ask the registry (attributes, launchers), never compare a kernel's name."""
    import re
    from pathlib import Path

    names = {k.name for k in registry.KERNELS}
    root = Path(registry.__file__).parent / "backends"
    for path in (root / "cuda.py", root / "nccl.py", root / "cpu.py", root / "_cuda_kernels.py",
                 root / "_compressed_cuda.py", root / "_cuda_plan.py"):
        text = path.read_text()
        for name in names:
            hits = re.findall(rf'(?:[=!]=|\bin)\s*\(?[^\n]*?"{name}"', text)
            assert not hits, f"{path.name} compares {name!r}: {hits}"

# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("backend", "key", "name", "gpus", "layout", "message"),
    [
        ("cpu", "fp", "merge", 1, None, "unknown forward-projection kernel 'merge' for backend cpu; valid: auto, numba, scipy"),
        ("cpu", "bp", "scatter", 1, None, "valid: auto, numba, scipy, notrans"),
        ("cuda", "bp", "numba", 1, None, "unknown back-projection kernel 'numba' for backend cuda"),
        ("cuda", "fp", "csr_vectr", 1, None, "valid: auto, csr_vector, csr_scalar, merge, cusparse"),
        ("cuda", "bp", "scatter_smem", 2, "thesis", "'scatter_smem' of backend cuda does not run on 2 GPUs in the thesis layout"),
        ("cuda", "bp", "scatter", 2, "thesis", "does not run on 2 GPUs in the thesis layout"),
        ("opencl", "fp", "auto", 1, None, "unknown backend 'opencl'"),
    ],
)
def test_check_refuses_in_one_line(backend, key, name, gpus, layout, message):
    with pytest.raises(ConfigError) as err:
        registry.check(key, name, backend, gpus=gpus, layout=layout)
    text = str(err.value)
    assert message in text
    assert "\n" not in text


def test_check_run_names_the_config_key():
    registry.check_run({"backend": "cuda", "fp": "csr_vector", "bp": "scatter", "gpus": [1, 2], "layout": ["local"]})
    with pytest.raises(ConfigError, match=r"^runs\[3\]\.bp: .*thesis layout"):
        registry.check_run({"backend": "cuda", "bp": "scatter", "gpus": [1, 2], "layout": ["local", "thesis"]}, "runs[3]")
    with pytest.raises(ConfigError, match=r"^runs\[0\]\.fp: unknown"):
        registry.check_run({"backend": "cpu", "fp": "csr_vector"}, "runs[0]")


@pytest.mark.parametrize(
    ("backend", "bp", "expected"),
    [
        ("cpu", "auto", True), ("cpu", "numba", True), ("cpu", "scipy", True), ("cpu", "notrans", False),
        ("cuda", "auto", True), ("cuda", "csr_vector", True), ("cuda", "merge", True), ("cuda", "cusparse", True),
        ("cuda", "notrans", False), ("cuda", "scatter", False), ("cuda", "scatter_vec", False),
        ("cuda", "scatter_smem", False), ("cuda", "cusparse_notrans", False),
    ],
)
def test_uses_transpose_names_the_runs_that_read_transpose_h5(backend, bp, expected):
    assert registry.uses_transpose(backend, bp) is expected


# --------------------------------------------------------------------------- one declaration, many readers
def test_every_kernel_declared_once_and_its_source_exists():
    keys = [(k.backend, k.op, k.name) for k in registry.KERNELS]
    assert len(keys) == len(set(keys))
    for k in registry.KERNELS:
        assert k.op in registry.OPS and k.backend in registry.BACKENDS
        assert set(k.formats) <= set(registry.FORMATS)
        assert set(k.layouts) <= set(registry.LAYOUTS)
        assert not (k.backend == "cpu" and k.layouts)
        for part in k.source.split(";"):
            path, _, funcs = part.strip().partition(": ")
            if not path.startswith("mlemlib/"):
                continue
            text = (REPO / path).read_text()
            for func in re.split(r"\s*/\s*", funcs.split(" on ")[0]):
                stem = re.sub(r"<\w+>_?", "", func.strip())  # cspmv_<kind>_L -> cspmv_L
                stem = stem[:-2] if stem.endswith("_L") else stem  # a template family: csr_vector_L
                assert stem and stem in text, f"{k.name}: {func} not in {path}"


def test_schema_enum_is_the_registry():
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    run = schema["properties"]["runs"]["items"]["properties"]
    assert run["fp"]["enum"] == registry.all_names("fp")
    assert run["bp"]["enum"] == registry.all_names("bp")
    assert run["backend"]["enum"] == list(registry.BACKENDS)


def test_bench_times_every_cuda_kernel_with_the_registry_labels():
    for op, kernels in (("fp", bench.FP_BENCH), ("bp", bench.BP_BENCH), ("bp_notrans", bench.NOTRANS_BENCH)):
        declared = [k.name for k in registry.KERNELS
                    if k.backend == "cuda" and k.op == bench.BENCH_OPS[op] and not k.selector and "csr" in k.formats]
        assert list(kernels) == declared
        for name in kernels:
            assert bench.deterministic(op, name) is registry.get("cuda", bench.BENCH_OPS[op], name).deterministic
    assert bench.deterministic("fp", "cusparse") is False  # measured: three runs, three images
    for fp, bp in bench.ITERATION_BENCH:
        registry.resolve("cuda", fp, bp)  # every timed pair is a valid configuration


def test_mlem_kernels_prints_the_registry(capsys):
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| cuda") or line.startswith("| cpu")]
    assert len(rows) == len(registry.KERNELS)
    assert "| cuda | back_notrans | scatter_smem | csr | no | local |" in out
    assert "auto:" in out
    assert main(["kernels", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(k["backend"], k["op"], k["name"]) for k in data["kernels"]] == [
        (k.backend, k.op, k.name) for k in registry.KERNELS
    ]
    assert data["auto"] == list(registry.AUTO_RULES)


# --------------------------------------------------------------------------- import structure
def _module_graph(root: Path) -> dict[str, set[str]]:
    """mlemlib's modules and the mlemlib modules each imports (anywhere in it, lazily too, parents included)."""
    files = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = p
    graph = {}
    for name, p in files.items():
        pkg = name if p.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                    base = f"{up}.{base}" if base else up
                for a in node.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base)
        edges = set()
        for mod in found:
            bits = mod.split(".")
            edges.update(".".join(bits[:i]) for i in range(2, len(bits) + 1))  # importing a.b.c runs a.b
        graph[name] = {m for m in edges if m in files and m != name and not name.startswith(m + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_circle(tmp_path):
    pkg = tmp_path / "mlemlib"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from mlemlib.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from mlemlib import a\n")
    (pkg / "c.py").write_text("import mlemlib.a\n")
    assert _cycles(_module_graph(pkg)) == [["mlemlib.a", "mlemlib.sub.b"]]


def test_no_import_circle_in_mlemlib():
    assert _cycles(_module_graph(REPO / "mlemlib")) == []


def test_workflow_refuses_a_kernel_its_run_does_not_have(tmp_path):
    from test_workflow import changed, snakemake

    config = changed(runs=[{"backend": "cpu"}, {"backend": "cuda", "bp": "scatter", "gpus": [2], "layout": ["thesis"]}])
    config["use_gpu"] = True
    proc = snakemake(tmp_path, "--dry-run", config=config)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    line = next(x for x in out.splitlines() if "runs[1].bp" in x)
    assert "thesis layout" in line and "valid: auto, csr_vector" in line
    assert not (tmp_path / "results").exists()
