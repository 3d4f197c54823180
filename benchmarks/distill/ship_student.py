"""Ship a finished LoRA student in the package (its adapter, record, training curve and the
teacher-forced reference scores a fresh clone must reproduce):
``python benchmarks/distill/ship_student.py RUN_DIR DEST``."""

import sys

from mistill_lens.distill.shipping import ship_student

if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(ship_student(sys.argv[1], sys.argv[2]))
