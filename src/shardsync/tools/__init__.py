"""The programs behind the CLI: bench, baseline, demo (zoo and real vLLM), localcluster, sim."""
