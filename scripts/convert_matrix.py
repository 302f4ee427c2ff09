"""Rule convert_matrix: validate any supported matrix file into matrix.h5."""

import logging

from mlemlib.logs import send_to_log

send_to_log(snakemake.log[0])

from mlemlib.fold import convert_stage  # noqa: E402

# fold: each distinct row once, with the map from the user's rows (docs/formats.md); a compressed
# container kept in its own format is copied with its stored values bit for bit (convert does it);
# clip_negative: values below zero set to 0 (mlem convert --clip-negative); geometry: the grid and voxel
# size recorded (mlem convert --grid --voxel-size; None: the source's own)
summary = convert_stage(snakemake.input.source, snakemake.output.matrix, fmt=snakemake.params.format,
                        fold=snakemake.params.fold, clip_negative=snakemake.params.clip_negative,
                        grid=snakemake.params.geometry["grid"], voxel_size=snakemake.params.geometry["voxel_size"])
logging.info("convert_matrix: %s", summary)
