"""Pretrain small LMs with sink-relevant attention variants."""
