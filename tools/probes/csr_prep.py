"""Parent of the CSR-share probe: prepare madpet2-own-csr and its 4-part plan, save g and norm for the ranks."""
import json, os, time
import numpy as np
from mlemlib.bench.cases import load_cases, select
from mlemlib.bench.factors import bench_problem
from mlemlib.bench.runner import prepare_case
from mlemlib.bench.prepare import partition

case = select(load_cases("perf/cases.yaml"), ["madpet2-own-csr"])[0]
t0 = time.time()
prep = prepare_case(case, "/tmp/bench")[0]
prob = bench_problem(prep, "none")
np.save("/tmp/probe_g.npy", np.asarray(prob.g)); np.save("/tmp/probe_norm.npy", np.asarray(prob.norm))
plan = partition(case, prep, 4)
json.dump({"matrix": os.fspath(prep.matrix), "transpose": os.fspath(prep.transpose) if prep.transpose else None,
           "plan": os.fspath(plan), "layout": case.layout or "local"}, open("/tmp/probe.json", "w"))
print(f"prepared in {time.time() - t0:.1f} s; transpose {prep.transpose}; plan {plan}", flush=True)
