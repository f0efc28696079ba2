"""dpkit inside other training frameworks: Hugging Face's Trainer (`hf_trainer`)."""
