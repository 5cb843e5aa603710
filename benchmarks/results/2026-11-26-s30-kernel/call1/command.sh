# session 30, call 1: is h=128's page-16 / page-1 gap to page 64 the pages' scatter? The same shapes with pages in order
# ("seq") next to random order, and the producer asking L2 for each page's first line (PAGE_PF=1: warms the address
# translation) or the whole block (PAGE_PF=2) once it has the page ids, before its buffer wait. Our kernel alone.
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv | tee $OUT/gpu.txt
S="128,16384,128,1,16;128,16384,128,1,1;128,16384,128,1,64;64,8192,128,2,16;128,16384,128,1,16,seq;128,16384,128,1,1,seq;128,16384,128,1,64,seq"
for pf in 0 1 2; do MLA_BACKEND_SM90_PAGE_PF=$pf timeout 300 python3 scripts/quick_time.py --shapes "$S" --precompile 4 > $OUT/pre$pf.log 2>&1 & done; wait
tail -n 2 $OUT/pre*.log
AB_ROUNDS=4 timeout 400 python3 scripts/ab_interleave.py "$S" "base:" "pf1:MLA_BACKEND_SM90_PAGE_PF=1" "pf2:MLA_BACKEND_SM90_PAGE_PF=2" 2>&1 | grep -E "b=|Error|error" | tee $OUT/ab.log
