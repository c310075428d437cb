"""The coverage suite's architectures: real model families, random weights, no downloads.

`build(name, device, scale)` gives (model, example inputs) from a fixed seed, so that every
process builds the same weights and inputs. scale "small" fits a CPU; "large" is for GPUs;
"tiny" (the integration tier's) is "small" with one transformer layer, two RNN steps and two
ResNet stages: the same mechanisms, fewer kernels to compile.
Dropout is zero everywhere: compiled code draws random numbers differently from eager, and
the suite compares numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ---- transformers (configs only: random initialisation) --------------------------------


def _hf(scale: str) -> dict:
    return {
        "tiny": dict(hidden=32, layers=1, heads=4, seq=8, batch=2),
        "small": dict(hidden=64, layers=2, heads=4, seq=16, batch=2),
        "large": dict(hidden=512, layers=4, heads=8, seq=128, batch=8),
    }[scale]


def bert(scale):
    from transformers import BertConfig, BertForSequenceClassification

    s = _hf(scale)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=1000,
            hidden_size=s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            intermediate_size=4 * s["hidden"],
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )
    ids = torch.randint(0, 1000, (s["batch"], s["seq"]))
    return model, (ids, torch.ones_like(ids), torch.randint(0, 3, (s["batch"],)))


def _causal_lm(model, s):
    """A causal LM with its training inputs: token ids, no mask, the ids as labels."""
    ids = torch.randint(0, 1000, (s["batch"], s["seq"]))
    return model, (ids, None, ids)


def gpt2(scale):
    from transformers import GPT2Config, GPT2LMHeadModel

    s = _hf(scale)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=1000,
            n_positions=256,
            n_embd=s["hidden"],
            n_layer=s["layers"],
            n_head=s["heads"],
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    return _causal_lm(model, s)


def llama_gqa(scale):
    from transformers import LlamaConfig, LlamaForCausalLM

    s = _hf(scale)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=1000,
            hidden_size=s["hidden"],
            intermediate_size=3 * s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["heads"] // 2,
            max_position_embeddings=256,
        )
    )
    return _causal_lm(model, s)


def mixtral_moe(scale):
    from transformers import MixtralConfig, MixtralForCausalLM

    s = _hf(scale)
    model = MixtralForCausalLM(
        MixtralConfig(
            vocab_size=1000,
            hidden_size=s["hidden"],
            intermediate_size=2 * s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["heads"] // 2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=256,
        )
    )
    return _causal_lm(model, s)


def t5(scale):
    from transformers import T5Config, T5ForConditionalGeneration

    s = _hf(scale)
    model = T5ForConditionalGeneration(
        T5Config(
            vocab_size=1000,
            d_model=s["hidden"],
            d_kv=s["hidden"] // s["heads"],
            d_ff=4 * s["hidden"],
            num_layers=s["layers"],
            num_heads=s["heads"],
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
    )
    ids = torch.randint(1, 1000, (s["batch"], s["seq"]))
    return model, (ids, None, torch.randint(1, 1000, (s["batch"], s["seq"] // 2)))


def bart(scale):
    from transformers import BartConfig, BartForConditionalGeneration

    s = _hf(scale)
    model = BartForConditionalGeneration(
        BartConfig(
            vocab_size=1000,
            d_model=s["hidden"],
            encoder_layers=s["layers"],
            decoder_layers=s["layers"],
            encoder_attention_heads=s["heads"],
            decoder_attention_heads=s["heads"],
            encoder_ffn_dim=4 * s["hidden"],
            decoder_ffn_dim=4 * s["hidden"],
            max_position_embeddings=256,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        )
    )
    ids = torch.randint(3, 1000, (s["batch"], s["seq"]))
    return model, (ids, None, torch.randint(3, 1000, (s["batch"], s["seq"] // 2)))


def vit(scale):
    from transformers import ViTConfig, ViTForImageClassification

    s = _hf(scale)
    size = 32 if scale != "large" else 224
    model = ViTForImageClassification(
        ViTConfig(
            image_size=size,
            patch_size=8 if scale != "large" else 16,
            num_channels=3,
            hidden_size=s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            intermediate_size=4 * s["hidden"],
            num_labels=10,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )
    return model, (
        torch.randn(s["batch"], 3, size, size),
        None,
        torch.randint(0, 10, (s["batch"],)),
    )


def whisper_encoder(scale):
    from transformers import WhisperConfig, WhisperForAudioClassification

    s = _hf(scale)
    frames = 64 if scale != "large" else 1500
    model = WhisperForAudioClassification(
        WhisperConfig(
            num_mel_bins=16,
            d_model=s["hidden"],
            encoder_layers=s["layers"],
            encoder_attention_heads=s["heads"],
            encoder_ffn_dim=4 * s["hidden"],
            decoder_layers=1,
            decoder_attention_heads=s["heads"],
            max_source_positions=frames,
            num_labels=5,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        )
    )
    return model, (
        torch.randn(s["batch"], 16, 2 * frames),
        None,
        torch.randint(0, 5, (s["batch"],)),
    )


class HFTask(nn.Module):
    """Calls a transformers model as training code does: inputs, mask, labels -> loss and
    logits (a tuple, so that every architecture returns plain tensors)."""

    def __init__(self, model: nn.Module, input_name: str, label_name: str = "labels"):
        super().__init__()
        self.model, self.input_name, self.label_name = model, input_name, label_name

    def forward(self, inputs, mask, labels):
        kwargs = {self.input_name: inputs, self.label_name: labels}
        if mask is not None:
            kwargs["attention_mask"] = mask
        out = self.model(**kwargs)
        return out.loss, out.logits


# ---- hand-written and torch.nn architectures -------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.down(x))


class ResNet(nn.Module):
    def __init__(self, width: int = 16, classes: int = 10, stages: int = 4):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        chans = [width * 2**i for i in range(stages)]
        self.stages = nn.Sequential(
            *(BasicBlock(chans[max(i - 1, 0)], c, 1 if i == 0 else 2) for i, c in enumerate(chans))
        )
        self.fc = nn.Linear(chans[-1], classes)

    def forward(self, x):
        return self.fc(self.stages(self.stem(x)).mean((2, 3)))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int = 4):
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.body = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x):
        return x + self.body(x) if self.use_res else self.body(x)


class MobileNetV2(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU6(),
            InvertedResidual(16, 16, 1),
            InvertedResidual(16, 24, 2),
            InvertedResidual(24, 24, 1),
            InvertedResidual(24, 32, 2),
        )
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pw1, self.pw2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.gamma * self.pw2(F.gelu(self.pw1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, dim: int = 32, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, 4)
        self.blocks = nn.Sequential(ConvNeXtBlock(dim), ConvNeXtBlock(dim))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class UNet(nn.Module):
    def __init__(self, c: int = 8):
        super().__init__()

        def conv(cin, cout):
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU()
            )

        self.d1, self.d2, self.mid = conv(3, c), conv(c, 2 * c), conv(2 * c, 2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, 2)
        self.u1 = conv(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        a = self.d1(x)
        b = self.mid(self.d2(F.max_pool2d(a, 2)))
        return self.out(self.u1(torch.cat([self.up(b), a], 1)))


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab: int = 500, dim: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.lstm(self.emb(ids))[0])


class BiGRUClassifier(nn.Module):
    """Bidirectional GRU over a sequence, mean-pooled into a classifier."""

    def __init__(self, dim: int = 48, classes: int = 6):
        super().__init__()
        self.gru = nn.GRU(dim, dim, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * dim, classes)

    def forward(self, x):
        return self.head(self.gru(x)[0].mean(1))


class TorchTransformer(nn.Module):
    """torch.nn.TransformerEncoder, batch first, with a causal mask."""

    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.encoder(x, mask=mask, is_causal=True)


class DLRM(nn.Module):
    """Sparse features through EmbeddingBags, dense through an MLP, pairwise dot interaction."""

    def __init__(self, tables: int = 4, rows: int = 1000, dim: int = 16):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, dim))
        pairs = (tables + 1) * tables // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense, sparse, offsets):
        feats = [self.bottom(dense)] + [bag(sparse[i], offsets) for i, bag in enumerate(self.bags)]
        z = torch.stack(feats, 1)
        inter = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.triu_indices(z.shape[1], z.shape[1], offset=1)
        return self.top(torch.cat([feats[0], inter[:, i, j]], 1))


class DataDependentBranch(nn.Module):
    """Python control flow on a tensor's value: Dynamo breaks the graph at .item()."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if h.mean().item() > 0:
            h = self.b(h) * 2
        else:
            h = F.relu(self.b(h))
        return self.c(h)


class CondBranch(nn.Module):
    """The same choice made inside the graph with torch.cond."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.cond(h.mean() > 0, lambda t: self.b(t) * 2, lambda t: F.relu(self.b(t)), (h,))
        return self.c(h)


class BatchNormTraining(nn.Module):
    """In-place buffer updates: running mean/var and the batch counter change every step."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn1 = nn.Linear(32, 64), nn.BatchNorm1d(64, momentum=0.3)
        self.conv, self.bn2 = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.out = nn.Linear(64 + 4, 10)

    def forward(self, x):
        h = F.relu(self.bn1(self.fc(x)))
        img = F.relu(self.bn2(self.conv(h.view(-1, 1, 8, 8)))).mean((2, 3))
        return self.out(torch.cat([h, img], 1))


class ScaledSiLU(torch.autograd.Function):
    """A custom autograd.Function with a hand-written backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * torch.sigmoid(x) * scale

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * ctx.scale * (s + x * s * (1 - s)), None


class CustomFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.b(ScaledSiLU.apply(self.a(x), 1.5))


def _images(scale, size_small=32, size_large=224, channels=3):
    batch, size = (4, size_small) if scale != "large" else (32, size_large)
    return torch.randn(batch, channels, size, size)


def _dlrm_inputs(scale):
    batch = 8 if scale != "large" else 2048
    return (
        torch.randn(batch, 13),
        torch.randint(0, 1000, (4, batch * 3)),
        torch.arange(0, batch * 3, 3),
    )


# name -> (what it is, builder(scale) -> (model, inputs))
ARCHITECTURES = {
    "bert": ("transformers BERT, sequence classification", lambda s: _task(bert(s), "input_ids")),
    "gpt2": ("transformers GPT-2, causal LM", lambda s: _task(gpt2(s), "input_ids")),
    "llama-gqa": (
        "transformers LLaMA, grouped-query attention (4 heads, 2 KV heads), RoPE",
        lambda s: _task(llama_gqa(s), "input_ids"),
    ),
    "mixtral-moe": (
        "transformers Mixtral, mixture of experts (4 experts, top-2)",
        lambda s: _task(mixtral_moe(s), "input_ids"),
    ),
    "t5": (
        "transformers T5, encoder-decoder, relative position bias",
        lambda s: _task(t5(s), "input_ids"),
    ),
    "bart": ("transformers BART, encoder-decoder", lambda s: _task(bart(s), "input_ids")),
    "vit": ("transformers ViT, image classification", lambda s: _task(vit(s), "pixel_values")),
    "whisper-encoder": (
        "transformers Whisper encoder, audio classification",
        lambda s: _task(whisper_encoder(s), "input_features"),
    ),
    "resnet": (
        "ResNet (basic blocks, BatchNorm)",
        # tiny: the first two stages (a block with an identity shortcut, one with a strided
        # 1x1 conv + BatchNorm shortcut): 12 s of compiling instead of 33
        lambda s: (ResNet(stages=2 if s == "tiny" else 4), (_images(s),)),
    ),
    "mobilenet-v2": (
        "MobileNetV2 (inverted residuals, depthwise convs, ReLU6)",
        lambda s: (MobileNetV2(), (_images(s),)),
    ),
    "convnext": (
        "ConvNeXt blocks (7x7 depthwise, LayerNorm, layer scale)",
        lambda s: (ConvNeXt(), (_images(s),)),
    ),
    "unet": (
        "U-Net (GroupNorm, SiLU, transposed conv, skip concat)",
        lambda s: (UNet(), (_images(s, 32, 128),)),
    ),
    # Dynamo unrolls an RNN's time steps into the graph, so the large scale grows the batch
    "lstm-lm": (
        "2-layer LSTM language model",
        # small: 8 steps, tiny 2, a step that reads the state of the one before (Dynamo
        # unrolls the recurrence into the graph: 16 took CI 4 minutes, 8 about 2.5, 4 about
        # 2; alone on the 2-core box 4 took 42 s, 2 about 34)
        lambda s: (
            LSTMLanguageModel(),
            (torch.randint(0, 500, {"tiny": (4, 2), "small": (4, 8)}.get(s, (256, 16))),),
        ),
    ),
    "bigru": (
        "bidirectional GRU classifier",
        lambda s: (BiGRUClassifier(), (torch.randn(4 if s != "large" else 256, 20, 48),)),
    ),
    "nn-transformer": (
        "torch.nn.TransformerEncoder, causal mask",
        lambda s: (
            TorchTransformer(),
            (torch.randn(*((2, 16) if s != "large" else (16, 256)), 64),),
        ),
    ),
    "dlrm": (
        "DLRM-style recommender (EmbeddingBag, dot interaction)",
        lambda s: (DLRM(), _dlrm_inputs(s)),
    ),
    "graph-break": (
        "data-dependent Python branch (graph break at .item())",
        lambda s: (DataDependentBranch(), (torch.randn(8, 32),)),
    ),
    "torch-cond": (
        "the same branch with torch.cond",
        lambda s: (CondBranch(), (torch.randn(8, 32),)),
    ),
    "batchnorm-train": (
        "BatchNorm1d/2d buffer updates (in-place) in training",
        lambda s: (BatchNormTraining(), (torch.randn(8, 32),)),
    ),
    "custom-function": (
        "custom torch.autograd.Function with its own backward",
        lambda s: (CustomFunction(), (torch.randn(8, 32),)),
    ),
}


def _task(built, input_name):
    model, inputs = built
    return HFTask(model, input_name), inputs


def build(name: str, device: str = "cpu", scale: str = "small"):
    """(model, inputs) on `device`, the same in every process; no dropout anywhere."""
    torch.manual_seed(0)
    model, inputs = ARCHITECTURES[name][1](scale)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model.to(device), tuple(
        x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs
    )
