"""Shared test setup: keep transformers quiet."""

import warnings

from transformers import logging as hf_logging

hf_logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")
