"""A one-device Fabric model and optimizer, and checkpoint saves of it, for the checkpoint tests."""

import torch

from gdn2.checkpoint.state import save_checkpoint
from gdn2.config import Config
from gdn2.model import GPT
from gdn2.train.fabric_api import Fabric, unwrap
from train_helpers import MICRO_MODEL


class Boom(RuntimeError):
    pass


def make_fabric_model():
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    torch.manual_seed(0)
    model = GPT(Config(**MICRO_MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer


def train_a_step(model, optimizer):
    idx = torch.randint(0, 256, (2, 16))
    model(idx).float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def save(fabric, model, optimizer, root, step, **kw):
    state = {"model": unwrap(model), "optimizer": unwrap(optimizer), "trainer": {"step": step}}
    return save_checkpoint(fabric, root, step, state,
                           rank_state={"data": {"n": step}}, config_yaml=kw.pop("config_yaml", "model: {}\n"),
                           info={"tokens": step * 10}, keep_last=kw.pop("keep_last", 3), **kw)
