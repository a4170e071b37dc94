"""Sizing a job: what running a model holds beyond its weights, by the libraries' own rules.

``probe`` runs the job's forwards on the meta device in a bounded child Python and reads back the
KV cache transformers really keeps (after the prompt and at the whole context) and the LoRA
adapters peft really adds; ``training`` turns parameters into gradients and optimizer state as
torch.optim creates them; ``parts`` puts a checkpoint's weights and a job (records.job) together
into the parts the fit check compares with each device's budget.
"""
