#!/bin/bash
exec $NCU python3 build/csr_rank.py multi > $OUT/ncu_rank$MLEM_RANK.txt 2>&1
