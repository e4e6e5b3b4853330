#!/usr/bin/env bash
# What hookkit holds in memory that the peer does not, counted on the CPU.
# benchmarks/held_memory.py (weights selected for fp8, DBCache's graph buffers): held_memory.json, .md.
source "$(dirname "$0")/../suite_lib.sh"
python3 benchmarks/held_memory.py --out "$OUT"
note "held memory rc $?"
