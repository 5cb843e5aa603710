# session 24, call 4 (carries .devkit/vllm-c.tar.xz + unpack.sh): unpack the first vLLM bundle for calls 5-6
source .devkit/unpack.sh; nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
