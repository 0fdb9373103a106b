"""Integrations with inference engines and schedulers. Only this package imports vllm."""
