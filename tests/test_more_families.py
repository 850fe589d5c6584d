"""Any ``AutoModel``: families beyond ``tiny_models.FAMILIES`` (text, images, audio) train like the untouched model.

The other tests exercise the engine in depth on thirteen families. This one is broad instead:
each family below (causal LMs with and without rotary, fused QKV, mixture of experts, a state
space model, masked LMs, encoder-decoders, and classification, token and QA heads) trains
three AdamW steps through ``offload_model`` with a window of one, by default and with every
block tiled, against a deep copy trained with ``torch.optim.AdamW`` from the same seed. The
losses agree to fp32 rounding.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers as T

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf import query_tiling
from stronghold_hf.tiling import tiled_modules

VOCAB = 128
_LLAMA_LIKE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=64, vocab_size=VOCAB)
_BERT_LIKE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_BART_LIKE = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, dropout=0.0, attention_dropout=0.0)

#: family -> (auto class, config class, config fields)
CASES = {
    "phi3": ("AutoModelForCausalLM", "Phi3Config", dict(_LLAMA_LIKE, pad_token_id=0)),
    "qwen3": ("AutoModelForCausalLM", "Qwen3Config", dict(_LLAMA_LIKE, head_dim=16)),
    "qwen3_moe": ("AutoModelForCausalLM", "Qwen3MoeConfig", dict(_LLAMA_LIKE, head_dim=16, moe_intermediate_size=32,
                                                                  num_experts=4, num_experts_per_tok=2)),
    "gemma3_text": ("AutoModelForCausalLM", "Gemma3TextConfig", dict(_LLAMA_LIKE, head_dim=16)),
    "olmo2": ("AutoModelForCausalLM", "Olmo2Config", _LLAMA_LIKE),
    "cohere": ("AutoModelForCausalLM", "CohereConfig", _LLAMA_LIKE),
    "gptj": ("AutoModelForCausalLM", "GPTJConfig", dict(n_embd=32, n_layer=2, n_head=2, rotary_dim=8, vocab_size=VOCAB,
                                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "bloom": ("AutoModelForCausalLM", "BloomConfig", dict(hidden_size=32, n_layer=2, n_head=2, vocab_size=VOCAB,
                                                          hidden_dropout=0.0, attention_dropout=0.0)),
    "gpt_bigcode": ("AutoModelForCausalLM", "GPTBigCodeConfig", dict(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB,
                                                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "mpt": ("AutoModelForCausalLM", "MptConfig", dict(d_model=32, n_layers=2, n_heads=2, vocab_size=VOCAB,
                                                      expansion_ratio=2)),
    "mamba": ("AutoModelForCausalLM", "MambaConfig", dict(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB,
                                                          state_size=4)),
    "roberta": ("AutoModelForMaskedLM", "RobertaConfig", _BERT_LIKE),
    "modernbert": ("AutoModelForMaskedLM", "ModernBertConfig", dict(hidden_size=32, num_hidden_layers=2,
                                                                    num_attention_heads=2, intermediate_size=64,
                                                                    vocab_size=VOCAB, pad_token_id=0)),
    "mbart": ("AutoModelForSeq2SeqLM", "MBartConfig", _BART_LIKE),
    # LayerDrop: each block is skipped at random in training (the same draws in both runs), so a
    # step's skipped blocks get no gradient and no update, weight decay included, as AdamW's.
    "m2m_100_layerdrop": ("AutoModelForSeq2SeqLM", "M2M100Config",
                          dict(_BART_LIKE, encoder_layerdrop=0.5, decoder_layerdrop=0.5)),
    "switch_transformers": ("AutoModelForSeq2SeqLM", "SwitchTransformersConfig",
                            dict(d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16,
                                 vocab_size=VOCAB, num_experts=4, expert_capacity=64, decoder_start_token_id=0,
                                 pad_token_id=0, dropout_rate=0.0)),
    # One layer's weights used at every depth.
    "albert": ("AutoModelForMaskedLM", "AlbertConfig", dict(_BERT_LIKE, embedding_size=16)),
    # Mamba and attention layers interleaved, one of them a mixture of experts.
    "jamba": ("AutoModelForCausalLM", "JambaConfig",
              dict(_LLAMA_LIKE, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                   expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2,
                   use_mamba_kernels=False)),
    "xlnet": ("AutoModelForCausalLM", "XLNetConfig", dict(d_model=32, n_layer=2, n_head=2, d_inner=64, vocab_size=VOCAB,
                                                          dropout=0.0)),
    # The sequence shrinks between blocks (pooling) and the decoder brings it back.
    "funnel": ("AutoModelForMaskedLM", "FunnelConfig",
               dict(block_sizes=[1, 1], num_decoder_layers=1, d_model=32, n_head=2, d_head=16, d_inner=64,
                    vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)),
    # A recurrence and a one-token shift in every block: nothing in it is per-token.
    "rwkv": ("AutoModelForCausalLM", "RwkvConfig", dict(hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                                        intermediate_size=64, vocab_size=VOCAB, context_length=64)),
    # Short convolutions and attention layers interleaved.
    "lfm2": ("AutoModelForCausalLM", "Lfm2Config", dict(_LLAMA_LIKE, layer_types=["conv", "full_attention"],
                                                        block_ff_dim=64, block_auto_adjust_ff_dim=False)),
    # An n-gram decoder: each block predicts two tokens ahead in streams of its own.
    "prophetnet": ("AutoModelForSeq2SeqLM", "ProphetNetConfig",
                   dict(hidden_size=32, num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=2,
                        num_decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, ngram=2, num_buckets=8,
                        relative_max_distance=16)),
    # Experts with a capacity of 64 tokens: not per-token in training, so never tiled; its
    # router sets its capacity in an eval forward (the probe's), which the probe puts back.
    "nllb_moe": ("AutoModelForSeq2SeqLM", "NllbMoeConfig",
                 dict(_BART_LIKE, num_experts=4, expert_capacity=64, encoder_sparse_step=2, decoder_sparse_step=2,
                      moe_token_dropout=0.0, activation_dropout=0.0)),
    # AltUp: the block's hidden states are stacked [2, b, s, h], its MLP and norms run on
    # [b, s, h] (tiled only since candidates may drop a leading axis of the block's input), and a
    # buffer its router reads is saved for backward before its submodules are probed (the
    # probe must not bump its version by writing back an unchanged buffer).
    "gemma3n_text": ("AutoModelForCausalLM", "Gemma3nTextConfig",
                     dict(_LLAMA_LIKE, head_dim=16, num_kv_shared_layers=0, laurel_rank=4, altup_num_inputs=2,
                          hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, intermediate_size=[64, 64],
                          activation_sparsity_pattern=[0.0, 0.0], layer_types=["sliding_attention", "full_attention"])),
    "llama_classification": ("AutoModelForSequenceClassification", "LlamaConfig",
                             dict(_LLAMA_LIKE, num_labels=3, pad_token_id=0)),
    "roberta_tokens": ("AutoModelForTokenClassification", "RobertaConfig", dict(_BERT_LIKE, num_labels=5)),
    "bert_qa": ("AutoModelForQuestionAnswering", "BertConfig", _BERT_LIKE),
}


def _batch(auto: str, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (2, 16), generator=g)
    out = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    if auto == "AutoModelForSeq2SeqLM":
        out["labels"] = torch.randint(1, VOCAB, (2, 8), generator=g)
    elif auto == "AutoModelForSequenceClassification":
        out["labels"] = torch.randint(0, 3, (2,), generator=g)
    elif auto == "AutoModelForTokenClassification":
        out["labels"] = torch.randint(0, 5, (2, 16), generator=g)
    elif auto == "AutoModelForQuestionAnswering":
        out["start_positions"] = torch.randint(0, 16, (2,), generator=g)
        out["end_positions"] = torch.randint(0, 16, (2,), generator=g)
    else:
        out["labels"] = ids.clone()
    return out


def _losses(model, optimizer, auto_or_batch) -> list[float]:
    """Three AdamW steps; ``auto_or_batch``: the auto class's name (`_batch`), or a function of
    the step that gives the batch."""
    batch = auto_or_batch if callable(auto_or_batch) else functools.partial(_batch, auto_or_batch)
    losses = []
    for step in range(3):
        torch.manual_seed(100 + step)  # the same random draws (LayerDrop, routing noise) in both runs
        loss = model(**batch(step)).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


#: The default engine, and every per-token module and causal block cut into tiles of 4 of the 16
#: tokens (sequence and attention tiling, both proven by their probes, never by class name).
CONFIGS = {"default": {}, "tiled": dict(sequence_tiling=True, attention_tiling=True, tile_tokens=4)}
#: Families where the tiling leaves everything whole, as its log lines say: mBART's decoder layer
#: raises in tiles (the probe catches it), its encoder layer takes no cache, and its per-token
#: modules save nothing worth tiling (native layer norms, MLPs written inline in the block).
#: XLNet's hidden states are time-major (``[tokens, batch, width]``): the tiles would cut its
#: batch, here 2 rows, less than one tile. RWKV's blocks mix each token with the one before it.
RUNS_WHOLE = {"mbart", "xlnet", "rwkv"}
#: ALBERT's one shared layer is one block, called at every depth.
ONE_BLOCK = {"albert"}
#: Causal families whose blocks the attention tiling runs in query tiles: GPT-BigCode, Bloom and
#: MPT name their cache argument ``layer_past``; Bloom's ALiBi is one bias per key, cut at each
#: tile's last key; Bloom's and MPT's blocks return tuples (MPT's with attention weights nobody
#: asked for), which their models index, so the tiled call returns a tuple too.
QUERY_TILED = {"phi3", "qwen3", "qwen3_moe", "gemma3_text", "olmo2", "cohere", "gptj", "gpt_bigcode", "bloom", "mpt",
               "llama_classification"}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("family", list(CASES))
def test_a_family_trains_like_the_untouched_model(family, config):
    auto, config_class, fields = CASES[family]
    torch.manual_seed(0)
    model = getattr(T, auto).from_config(getattr(T, config_class)(**fields))
    model.train()
    reference = copy.deepcopy(model)
    expected = _losses(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01), auto)

    engine = offload_model(model, StrongholdConfig(window_size=1, **CONFIGS[config]), device="cpu")
    assert engine.num_blocks >= (1 if family in ONE_BLOCK else 2), f"{family}: the blocks were not found"
    got = _losses(model, engine.build_optimizer(lr=1e-2, weight_decay=0.01), auto)
    query = query_tiling.installed(model)
    query_calls = query.calls if query is not None else 0
    tiled_calls = sum(site.calls for site in tiled_modules(model).values()) + query_calls
    engine.close()
    if config == "tiled" and family not in RUNS_WHOLE:
        assert tiled_calls > 0, f"{family}: nothing ran in tiles"
    if config == "tiled" and family in QUERY_TILED:
        assert query_calls > 0, f"{family}: its blocks did not run in query tiles"
    # Tiles sum attention and parameter gradients in another order: fp32 rounding, no more.
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6), (family, config, got, expected)


# ------------------------------------------------------------------ images, audio, both
def _generator(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(step)


def _images(size: int, labels: int | None = 3, tokens: int | None = None):
    def batch(step):
        g = _generator(step)
        out = dict(pixel_values=torch.randn(2, 3, size, size, generator=g))
        if tokens:
            out["labels"] = torch.randint(1, VOCAB, (2, tokens), generator=g)
        elif labels:
            out["labels"] = torch.randint(0, labels, (2,), generator=g)
        return out
    return batch


def _audio(step):
    g = _generator(step)
    return dict(input_values=torch.randn(2, 400, generator=g), labels=torch.randint(1, 12, (2, 5), generator=g))


def _mel(step):
    g = _generator(step)
    return dict(input_features=torch.randn(2, 16, 16, generator=g), labels=torch.randint(2, VOCAB, (2, 6), generator=g))


def _vit(**extra):
    return T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16,
                       patch_size=4, **extra)


def _vision_encoder_decoder():
    decoder = T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, add_cross_attention=True,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model = T.VisionEncoderDecoderModel(encoder=T.ViTModel(_vit()), decoder=decoder)
    model.config.decoder_start_token_id, model.config.pad_token_id = 1, 0
    return model


_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _clip():
    return T.CLIPModel(T.CLIPConfig(text_config=dict(_TOWER, vocab_size=VOCAB, max_position_embeddings=16),
                                    vision_config=dict(_TOWER, image_size=16, patch_size=4)))


def _image_and_text(step):
    """Four captions and four images, for a contrastive loss over the pairs."""
    g = _generator(step)
    return dict(input_ids=torch.randint(1, VOCAB, (4, 8), generator=g), pixel_values=torch.randn(4, 3, 16, 16, generator=g),
                return_loss=True)


_IMAGE_TOKEN = VOCAB - 1


def _llava():
    vision = T.CLIPVisionConfig(**_TOWER, image_size=16, patch_size=4)
    text = T.LlamaConfig(**_LLAMA_LIKE)
    return T.LlavaForConditionalGeneration(T.LlavaConfig(vision_config=vision, text_config=text, image_token_id=_IMAGE_TOKEN,
                                                         vision_feature_layer=-1, projector_hidden_act="gelu"))


def _text_with_an_image(step):
    """Two sequences of 24 tokens, 16 of them the image's (one per 4x4 patch of a 16x16 image)."""
    g = _generator(step)
    ids = torch.randint(1, VOCAB - 2, (2, 24), generator=g)
    ids[:, 2:18] = _IMAGE_TOKEN
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.randn(2, 3, 16, 16, generator=g),
                labels=ids.clone())



def _qwen2_5_vl():
    text = dict(_LLAMA_LIKE, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 10000.0})
    vision = dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  spatial_merge_size=2, in_channels=3, temporal_patch_size=2, window_size=8, fullatt_block_indexes=[1])
    return T.Qwen2_5_VLForConditionalGeneration(T.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=_IMAGE_TOKEN, video_token_id=VOCAB - 2,
        vision_start_token_id=VOCAB - 3, vision_end_token_id=VOCAB - 4))


def _text_with_flat_patches(step):
    """One sequence: an image of 4 x 4 patches (flattened, as Qwen-VL's processor gives them),
    merged 2 x 2 into 4 image tokens between its start and end tokens, inside 14 text tokens."""
    g = _generator(step)
    ids = torch.randint(1, VOCAB - 5, (1, 14), generator=g)
    image = torch.tensor([[VOCAB - 3] + [_IMAGE_TOKEN] * 4 + [VOCAB - 4]])
    ids = torch.cat([ids[:, :2], image, ids[:, 2:]], dim=1)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.randn(16, 3 * 2 * 4 * 4, generator=g),
                image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(ids == _IMAGE_TOKEN).long(),
                labels=ids.clone())


#: Models whose inputs are not token ids: name -> (build, batch of a step).
OTHER_INPUTS = {
    "vit": (lambda: T.AutoModelForImageClassification.from_config(_vit(num_labels=3)), _images(16)),
    "convnext": (lambda: T.AutoModelForImageClassification.from_config(
        T.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, image_size=32)), _images(32)),
    "wav2vec2_ctc": (lambda: T.AutoModelForCTC.from_config(T.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
        vocab_size=12, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0)), _audio),
    "whisper": (lambda: T.AutoModelForSpeechSeq2Seq.from_config(T.WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, num_mel_bins=16, max_source_positions=8,
        max_target_positions=32, dropout=0.0, decoder_start_token_id=1, pad_token_id=0)), _mel),
    "vision_encoder_decoder": (_vision_encoder_decoder, _images(16, tokens=6)),
    # Windowed attention over a hierarchy of patch merges.
    "swin": (lambda: T.AutoModelForImageClassification.from_config(T.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3,
        drop_path_rate=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), _images(32)),
    # Two towers (text and image) and a contrastive loss, no LM head.
    "clip": (_clip, _image_and_text),
    # An image tower whose patches, projected, replace the image tokens of a Llama's input.
    "llava": (_llava, _text_with_an_image),
    # Flattened patches, a vision tower with windowed and full attention blocks, and a text stack
    # whose rotary positions are three-dimensional (M-RoPE: time, height, width).
    "qwen2_5_vl": (_qwen2_5_vl, _text_with_flat_patches),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(OTHER_INPUTS))
def test_images_and_audio_train_like_the_untouched_model(name, config):
    """Image classification, CTC, speech-to-text, an image-to-text encoder-decoder, a contrastive
    pair of towers and an image-and-text LM: the blocks of each stack are found whatever the
    inputs, and three steps match AdamW on a deep copy."""
    build, batch = OTHER_INPUTS[name]
    torch.manual_seed(0)
    model = build()
    model.train()
    reference = copy.deepcopy(model)
    expected = _losses(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01), batch)
    engine = offload_model(model, StrongholdConfig(window_size=1, **CONFIGS[config]), device="cpu")
    assert engine.num_blocks >= 2, f"{name}: the blocks were not found"
    got = _losses(model, engine.build_optimizer(lr=1e-2, weight_decay=0.01), batch)
    engine.close()
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6), (name, config, got, expected)
