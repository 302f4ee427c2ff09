# The MLEM workflow: system matrix -> norm, transpose, partitions -> measurements
# -> reconstructions on CPUs and 1..N GPUs -> tables, plots and a report.
# See README.md for the stages and config/README.md for the settings.

from snakemake.utils import min_version

min_version("9.0")


# The embedded default; a --configfile (config/thesis.yaml, your own) replaces
# it instead of being merged into it, so that its matrices and runs are the
# only ones (keys it leaves out take the defaults of config/schema.yaml).
if not workflow.overwrite_configfiles:

    configfile: f"{workflow.basedir}/config/config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/matrix.smk"
include: "rules/reorder.smk"
include: "rules/norm.smk"
include: "rules/transpose.smk"
include: "rules/partition.smk"
include: "rules/chunk.smk"
include: "rules/data.smk"
include: "rules/mlem.smk"
include: "rules/convergence.smk"
include: "rules/summary.smk"


rule all:
    default_target: True
    input:
        get_final_outputs(),
