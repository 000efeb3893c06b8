"""The PPO critic: a value head on a causal LM's transformer body, one value per completion token.

``V(s_t)`` is read from the hidden state of the position that *predicts* completion token ``t``
(the last prompt token for ``t = 0``), so ``values[:, t]`` and ``logprobs[:, t]`` describe the
same state. ``load_critic`` builds one from the policy (body copy, zero head: the default), from a
reward model directory (its ``score`` layer becomes the head) or a :meth:`ValueModel.save`
directory, or from any other causal LM (its body, a zero head). ``shared_lora_critic``: policy
and critic share one frozen base with two LoRA adapters (``default`` and ``critic``); the
reference is then the base with adapters off.
More: docs/ppo.md, "Module notes", posttrain.models.value_head.

Notation: n sequences, P prompt tokens (left padded), T completion tokens (right padded),
H hidden size.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.core.device import autocast_ctx
from posttrain.core.padding import count_positions
from posttrain.models.loading import ModelLoadError
from posttrain.models.packing import packed_outputs
from posttrain.ops.masked import trim_padding

HEAD_FILE = "value_head.safetensors"
CRITIC_ADAPTER = "critic"


class ValueModel(nn.Module):
    """A transformer body plus a linear value head ``H -> 1`` (kept in fp32).

    Args:
        body: a decoder returning ``last_hidden_state`` (e.g. ``LlamaModel``; the body of a
            causal LM, ``model.get_decoder()``).
        hidden_size: H.
        peft_model / adapter: set for the shared-base LoRA critic: the body's forward passes
            run inside ``peft_model`` with ``adapter`` active.
    """

    def __init__(self, body: nn.Module, hidden_size: int, peft_model: Any = None,
                 adapter: str | None = None) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        # a plain attribute, not a submodule: the shared base is the policy's, not ours to save
        self.__dict__["peft_model"] = peft_model
        self.adapter = adapter

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The critic's own trainable parameters (the critic adapter + head when shared)."""
        if self.adapter is None:
            return [p for p in self.parameters() if p.requires_grad]
        own = [p for n, p in self.body.named_parameters()
               if p.requires_grad and f".{self.adapter}." in f".{n}."]
        return own + list(self.head.parameters())

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                response_mask: Tensor, autocast: bool = False, packing: bool = False) -> Tensor:
        """Values of the states before each completion token.

        Args:
            prompt_ids, prompt_mask: [n, P] left padded; completion_ids, response_mask: [n, T].
            packing: the rows run as one sequence (`posttrain.models.packing`).
        Returns:
            values [n, T] fp32; 0 on masked positions (they carry no state).
        """
        p_ids, p_mask, c_ids, c_mask = trim_padding(prompt_ids, prompt_mask, completion_ids,
                                             response_mask)
        ids = torch.cat([p_ids, c_ids], dim=1)  # [n, P'+T']
        attn = torch.cat([p_mask, c_mask], dim=1).long()  # [n, P'+T']
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [n, P'+T']
        t_cut = c_ids.shape[1]
        with self._adapter_active(), autocast_ctx(autocast, ids.device):
            if packing:  # [n, T', H], 0 at padded columns
                hidden = packed_outputs(self.body, ids, attn, p_ids.shape[1] - 1, t_cut)
            else:
                count_positions(attn)
                hidden = self.body(input_ids=ids, attention_mask=attn,
                                   position_ids=pos).last_hidden_state  # [n, P'+T', H]
                hidden = hidden[:, -t_cut - 1 : -1]  # [n, T', H] predicts completion token t
        hidden = hidden.float()
        values = self.head(hidden).squeeze(-1)  # [n, T']
        values = torch.where(c_mask.bool(), values, torch.zeros_like(values))  # [n, T']
        return nn.functional.pad(values, (0, completion_ids.shape[1] - t_cut))  # [n, T]

    def _adapter_active(self) -> contextlib.AbstractContextManager[Any]:
        if self.peft_model is None:
            return contextlib.nullcontext()
        return use_adapter(self.peft_model, self.adapter)

    def save(self, path: str | Path) -> Path:
        """Body with ``save_pretrained`` plus ``value_head.safetensors`` (not for the shared
        LoRA critic, whose body is the policy: that one saves its adapter and head)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.peft_model is not None:
            self.peft_model.save_pretrained(path / "adapters", selected_adapters=[self.adapter])
        else:
            self.body.save_pretrained(path, safe_serialization=True)
        save_file({k: v.detach().contiguous() for k, v in self.head.state_dict().items()},
                  str(path / HEAD_FILE))
        (path / "critic.json").write_text(json.dumps({"kind": "value_head"}) + "\n")
        return path



@contextlib.contextmanager
def use_adapter(peft_model: Any, name: str | None) -> Iterator[Any]:
    """Run ``peft_model`` with adapter ``name`` active; restore the previous one after.

    peft's ``set_adapter`` also freezes the inactive adapters; both adapters must stay
    trainable here (each has its own optimizer), so ``requires_grad`` flags are restored too.
    """
    previous = peft_model.active_adapter
    flags = {n: p.requires_grad for n, p in peft_model.named_parameters()}
    peft_model.set_adapter(name)
    try:
        yield peft_model
    finally:
        peft_model.set_adapter(previous)
        for n, p in peft_model.named_parameters():
            p.requires_grad_(flags[n])


def body_of(model: nn.Module) -> nn.Module:
    """The transformer body of a causal LM (without its LM head)."""
    body = getattr(model, "get_decoder", lambda: None)()
    if body is None:  # some families return None from get_decoder(): use the base model
        body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if body is None:
        raise ValueError(f"{type(model).__name__} has no get_decoder(): cannot find the body "
                         "under its LM head to put a value head on")
    return body


def critic_from_policy(policy: nn.Module) -> ValueModel:
    """A separate critic: a deep copy of the policy's body, a zero head."""
    body = copy.deepcopy(body_of(policy)).train().requires_grad_(True)
    return ValueModel(body, policy.config.hidden_size)


def shared_lora_critic(policy: Any, r: int, alpha: int,
                       target_modules: list[str] | str) -> ValueModel:
    """A critic that shares the policy's frozen base: a second LoRA adapter plus a head.

    ``policy`` must already be a peft LoRA model (adapter ``default``).
    """
    from peft import LoraConfig

    if not hasattr(policy, "peft_config"):
        raise ValueError("shared_lora_critic needs the policy wrapped in LoRA (lora_r > 0)")
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    policy.add_adapter(CRITIC_ADAPTER, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                  target_modules=targets))
    for n, p in policy.named_parameters():  # both adapters train, each with its optimizer
        if "lora_" in n:
            p.requires_grad_(True)
    hidden = policy.get_base_model().config.hidden_size
    return ValueModel(body_of(policy.get_base_model()), hidden, peft_model=policy,
                      adapter=CRITIC_ADAPTER)


def load_critic(path: str | Path, dtype: torch.dtype = torch.float32) -> ValueModel:
    """A critic from a directory: our saved critic, a 1-label sequence classifier (reward model)
    whose score layer becomes the head, or any causal LM (body only, zero head)."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"critic_model {str(path)!r}: no config.json; expected a directory "
                             "written by save_pretrained (a causal LM, a reward model or a "
                             "saved critic)")
    config = AutoConfig.from_pretrained(path)
    is_classifier = any(a.endswith("ForSequenceClassification")
                        for a in (config.architectures or []))
    if is_classifier:
        if config.num_labels != 1:
            raise ModelLoadError(f"critic_model {str(path)!r} is a classifier with "
                                 f"{config.num_labels} labels; a reward model used as critic "
                                 "must output one scalar (num_labels=1)")
        rm = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
        critic = ValueModel(getattr(rm, rm.base_model_prefix), config.hidden_size)
        score = rm.score
        with torch.no_grad():
            critic.head.weight.copy_(score.weight.float())
            if getattr(score, "bias", None) is not None:
                critic.head.bias.copy_(score.bias.float())
        return critic.train()
    critic = ValueModel(AutoModel.from_pretrained(path, dtype=dtype), config.hidden_size)
    if (path / HEAD_FILE).is_file():
        from safetensors.torch import load_file

        critic.head.load_state_dict(load_file(str(path / HEAD_FILE)))
    return critic.train()
