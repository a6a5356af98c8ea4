"""Deprecated: the registry of ``ascend-emu`` model ops and commands is ``ascend_emu.cli`` (one command-line module
per package). Importing this module warns and gives the same objects."""
import warnings

from .cli import COMMANDS, DEMO_STAGES, REGISTRY, Command, DemoStage, ModelOp, Option, command, demo_stage, register

warnings.warn("ascend_emu.ops is deprecated: import Option, register, command and demo_stage from ascend_emu.cli",
              DeprecationWarning, stacklevel=2)

__all__ = ["COMMANDS", "DEMO_STAGES", "REGISTRY", "Command", "DemoStage", "ModelOp", "Option", "command", "demo_stage",
           "register"]
