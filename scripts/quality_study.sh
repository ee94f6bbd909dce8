#!/bin/bash
# The quality study: python -m gdn2 study (gdn2/study.py), which this launcher runs with its arguments.
#
#   scripts/quality_study.sh DATA OUT [options] [-- --section.key value ...]
#
# Trains each config at each learning rate of --lrs on the same tokens in the same order, the extra
# seeds at each config's best rate, scores NIAH on request (--niah), and writes OUT/compare/compare.md
# and compare.png; runs that finished are not trained again. --help lists the options.
exec "${PYTHON:-python}" -m gdn2 study "$@"
