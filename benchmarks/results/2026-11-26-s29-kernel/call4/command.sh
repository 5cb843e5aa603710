# session 29, call 4 (machine of calls 1-3, warm): the combines' early metadata reverted (level in call 3). Interleaved
# A/B of q_rope_regs (S's rope WGMMAs from Q in registers) against MLA_BACKEND_SM90_QREG=0 at the shapes it touches
# (h x s_q >= 32, page 64), 6 rounds, our kernel alone.
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
S="128,16384,128,2,64;128,16384,128,1,64;64,32768,128,2,64;64,16384,64,2,64;128,4096,128,2,64;64,8192,128,1,64,ragged;128,8192,64,1,64"
AB_ROUNDS=6 timeout 400 python3 scripts/ab_interleave.py "$S" "qreg:" "qreg0:MLA_BACKEND_SM90_QREG=0" 2>&1 | grep "b=" | tee $OUT/ab.log
