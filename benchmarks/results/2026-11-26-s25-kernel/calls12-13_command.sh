# session 25, call 12 (carries vllm-c + unpack.sh; the machine of calls 10-11): source .devkit/unpack.sh
# session 25, call 13 (carries vllm-deps + unpack.sh; same machine): source .devkit/unpack.sh
