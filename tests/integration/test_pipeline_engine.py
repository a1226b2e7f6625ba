"""A real one-process PipelineModule + PipelineEngine on gloo (in a subprocess) against the HF model: GPT-2, BERT and
a Llama-class decoder (Qwen2 with its head tied to the embedding)."""
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-6

ENGINE_SCRIPT = textwrap.dedent('''
    import copy, json, sys
    import torch
    import deepspeed
    from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, Qwen2Config,
                              Qwen2ForCausalLM)
    from zerorun.pipeline import build_pipeline_module, export_state_dict
    from zerorun.train.trainer import init_distributed

    torch.set_num_threads(1)
    init_distributed(dist_backend="gloo", verbose=False)  # as a rank: no shm comm op to build
    results = {}

    def check(name, model, task, batches, interval):
        reference = copy.deepcopy(model)
        pipe = build_pipeline_module(model, task, num_stages=1, partition_method="parameters",
                                     activation_checkpoint_interval=interval)
        opt = torch.optim.SGD([p for p in pipe.parameters() if p.requires_grad], lr=0.5)
        ds_config = {"train_batch_size": 2 * len(batches), "train_micro_batch_size_per_gpu": 2,
                     "gradient_accumulation_steps": len(batches), "steps_per_print": 10 ** 9,
                     "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0}
        engine, _, _, _ = deepspeed.initialize(model=pipe, optimizer=opt, config=ds_config)
        eval_loss = engine.eval_batch(iter(batches)).item()
        train_loss = engine.train_batch(iter(batches)).item()

        reference.eval()
        with torch.no_grad():
            ref_eval = sum(reference(*x, labels=y).loss.item() for x, y in batches) / len(batches)
        reference.train()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
        ref_train = 0.0
        for x, y in batches:  # the engine's micro-batches: mean loss, gradients accumulated
            loss = reference(*x, labels=y).loss
            (loss / len(batches)).backward()
            ref_train += loss.item() / len(batches)
        ref_opt.step()
        exported, ref_sd = export_state_dict(engine.module, model), reference.state_dict()
        results[name] = {
            "eval": eval_loss, "ref_eval": ref_eval, "train": train_loss, "ref_train": ref_train,
            "same_names": list(exported) == list(ref_sd),
            "max_param_diff": max((exported[k] - ref_sd[k]).abs().max().item() for k in ref_sd),
            "moved": max((exported[k] - model_before[name][k]).abs().max().item() for k in ref_sd),
        }

    model_before = {}
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model_before["gpt2"] = copy.deepcopy(gpt2.state_dict())
    ids = [torch.randint(0, 256, (2, 16)) for _ in range(2)]
    check("gpt2", gpt2, "causal_lm", [((i,), i) for i in ids], interval=1)

    bert = BertForSequenceClassification(BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model_before["bert"] = copy.deepcopy(bert.state_dict())
    batches = []
    for width in (12, 9):  # padded per batch to its own width, as LabelledTexts does
        x = torch.randint(1, 256, (2, width))
        m = torch.ones(2, width, dtype=torch.long)
        m[1, width - 4:] = 0
        x[1, width - 4:] = 0
        batches.append(((x, m), torch.tensor([0, 1])))
    check("bert", bert, "sequence_classification", batches, interval=1)

    qwen2 = Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=True))
    model_before["qwen2"] = copy.deepcopy(qwen2.state_dict())
    check("qwen2", qwen2, "causal_lm", [((i,), i) for i in ids], interval=1)
    print("RESULT " + json.dumps(results), flush=True)
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_process_pipeline_engine_matches_hf(tmp_path):
    """PipelineModule(num_stages=1) + PipelineEngine: eval_batch and train_batch losses equal the HF
    model's, and one SGD step (2 micro-batches, activation checkpointing on) gives the same weights (the tied
    embedding's gradient summed over its two uses)."""
    script = tmp_path / "engine_check.py"
    script.write_text(ENGINE_SCRIPT)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # DeepSpeed builds its CPU shared-memory comm op on first use on a machine (minutes, then cached).
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900, start_new_session=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:]
    results = json.loads(lines[-1][len("RESULT "):])
    for name, r in results.items():
        assert r["same_names"], name
        assert abs(r["eval"] - r["ref_eval"]) <= ATOL, (name, r)
        assert abs(r["train"] - r["ref_train"]) <= ATOL, (name, r)
        assert r["max_param_diff"] <= ATOL, (name, r)
        assert r["moved"] > 1e-3, (name, r)  # the step did change the weights
