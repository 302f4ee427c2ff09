# The summary of this configuration (config key name) in its own folder,
# results/summary/{name}/: the tables as CSV and Markdown for reading and
# scripts, the same as HTML for the report (whose viewer shows HTML and
# images, not CSV or Markdown), and the plots.
#
# A local rule: under a cluster executor it runs in the main process, which
# decided which runs exist (--resources gpu=N and the GPUs seen by use_gpu: auto
# leave runs out). A cluster job parses the workflow again without --resources
# (Snakemake does not pass it on), on a node whose GPUs may differ, and would
# ask for runs the main process left out.
localrules:
    summarize,


rule summarize:
    input:
        unpack(get_summary_input),
    output:
        runs=PATHS["runs_csv"],
        convergence=get_convergence_table(),
        summary=PATHS["summary_md"],
        summary_html=report(
            PATHS["summary_html"],
            caption="../report/summary.rst",
            category="Tables",
        ),
        runs_html=report(
            PATHS["runs_html"],
            caption="../report/runs.rst",
            category="Tables",
        ),
        plots=report(
            directory(PATHS["plots"]),
            patterns=["{plot}.png"],
            caption="../report/plots.rst",
            category="Plots",
        ),
    log:
        f"logs/summary/{config['name']}.log",
    conda:
        "../envs/cpu.yaml"
    resources:
        mem_mb=SUMMARY_MEM_MB,
        disk_mb=get_disk_mb("summarize"),
    params:
        name=get_summary_name,
    script:
        "../scripts/summarize.py"
