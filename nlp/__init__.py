"""NLP domain: Llama models, language-model data and instruction fine-tuning data (plain torch/transformers)."""
