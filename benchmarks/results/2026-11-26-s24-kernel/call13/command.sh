# session 24, call 13 (carries vllm-deps + unpack.sh; after call 12 on the same machine; vllm-deps and tilelang together with the tree were over 64 MiB): source .devkit/unpack.sh
