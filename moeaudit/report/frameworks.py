"""The compliance frameworks as data: each item split into the aspects it asks for, each aspect
with the selectors (:mod:`moeaudit.report.evidence`) that can back it. Requirements are
one-sentence paraphrases, not the frameworks' text; ``docs/compliance.md`` cites the sources and
explains each mapping. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moeaudit.report.evidence import (
    AIO,
    DP,
    NCA,
    Aspect,
    Framework,
    Item,
    Selector,
    audit_energy,
    audit_flops,
    canary,
    checkpoint_files,
    ci95,
    claims,
    compared_gates,
    envelope,
    environment,
    events,
    gate_metrics,
    gate_progression,
    handoff,
    monitoring_logs,
    nll_by_domain,
    nll_series,
    parameters,
    policy,
    preregistration,
    refinement,
    refinement_gated,
    routed_shape,
    run_steps,
    signature,
    subjects,
    tool,
    verdict,
)

# --- the frameworks, as data ----------------------------------------------------------------------

A = Aspect
SIGNED = (signature,)
SCOPE = (
    "The certificate speaks about the training health of the audited checkpoints, measured "
    "on a fixed canary: it is one input to each item, never the whole of it."
)

EU_AI_ACT = Framework(
    "eu-ai-act",
    "EU AI Act — Annex IV and Annex XI Section 1",
    "Regulation (EU) 2024/1689: Annex IV (technical documentation of high-risk AI systems, "
    "Art. 11(1)) and Annex XI Section 1 (technical documentation of general-purpose AI models, "
    "Art. 53(1)(a))",
    "Requirements are paraphrased; the Regulation's text is binding. " + SCOPE,
    (
        Item(
            "Annex IV 2(b)",
            "Describe the system's design: its logic and algorithms, key choices "
            "and their rationale, what it optimises for, expected output quality, and the "
            "trade-offs accepted.",
            (
                A("general logic, algorithms and architecture"),
                A("key design choices, rationale and assumptions"),
                A("output quality on the training objective (canary next-token NLL)", (nll_series,)),
                A("acceptance thresholds for the training process, pinned by digest", (policy,)),
            ),
            note="The model's design and its rationale belong in the model's own documentation.",
        ),
        Item(
            "Annex IV 2(c)",
            "Describe the system architecture (how the software components fit "
            "together) and the compute used to develop, train, test and validate it.",
            (
                A("system architecture and how components integrate"),
                A("compute used to develop and train"),
                A("compute used to test and validate"),
            ),
            context=(
                (
                    environment,
                    "software and device class of the audit replay only: no "
                    "quantities, and nothing about the training job",
                ),
            ),
            note="The certificate records no compute quantity (FLOPs, accelerator hours).",
        ),
        Item(
            "Annex IV 2(d)",
            "Where relevant, document the training data: datasheets on the "
            "training methods and data sets, their provenance, scope and characteristics, and how "
            "they were obtained, selected, labelled and cleaned.",
            (
                A("training data sets: description, provenance, scope, characteristics"),
                A("how the data was obtained, selected, labelled and cleaned"),
            ),
            context=((canary, "the canary is a hashed evaluation probe set, not training data"),),
            note="The certificate holds only the canary's digest and shape; it carries no training-data provenance.",
        ),
        Item(
            "Annex IV 2(g)",
            "Describe the validation and testing procedures, the test data and "
            "its main characteristics, the metrics used (accuracy, robustness, discriminatory "
            "impact), with test logs and reports dated and signed by the responsible people.",
            (
                A("validation and testing procedure, gate by gate", (gate_progression, policy)),
                A("test data and its main characteristics", (canary,)),
                A("metrics measured at each gate", (gate_metrics, envelope)),
                A("tests of pre-determined changes (gated refinement or handoff margin)", (refinement_gated, handoff)),
                A("dated and signed test log", (signature, subjects)),
                A("signature tied to a named responsible person"),
                A("potentially discriminatory impacts"),
            ),
            note="A key id names a key, not a person: bind it to the responsible person in your "
            "key register. Discriminatory impact is not a training-health measurement.",
        ),
        Item(
            "Annex IV 4",
            "Explain why the chosen performance metrics suit this system.",
            (
                A("what each metric measures, licenses and does not license", (claims,)),
                A("suitability for the system's intended purpose"),
            ),
            note="Table 4 argues suitability for training health, not for the deployed task.",
        ),
        Item(
            "Annex IV 6",
            "Describe the relevant changes the provider made to the system over its lifecycle.",
            (
                A("changes between audited checkpoints, against the active baseline", (compared_gates,)),
                A("whether the last checkpoint refined or repurposed the routed model", (refinement,)),
                A("resumes and regime changes, each opening a new baseline", (events,)),
                A("changes after release"),
            ),
            note="Covers the audited training run only.",
        ),
        Item(
            "Annex XI §1.1",
            "Give a general description of the model: intended tasks and "
            "integrations, acceptable-use policy, release date and distribution, architecture "
            "and parameter count, input and output modality and format, licence.",
            (
                A("tasks and the AI systems it can be integrated in"),
                A("acceptable-use policy"),
                A("release date and distribution"),
                A("architecture"),
                A("number of parameters, total and active, counted from the weights", (parameters,)),
                A("modality and input/output format"),
                A("licence"),
            ),
            context=((subjects, "identifies the exact checkpoints audited, describes none"),),
        ),
        Item(
            "Annex XI §1.2(a)",
            "Describe the technical means (instructions, infrastructure, "
            "tools) needed to integrate the model into AI systems.",
            (A("integration instructions, infrastructure and tools"),),
        ),
        Item(
            "Annex XI §1.2(b)",
            "Describe the model's design and training process: methods and "
            "techniques, key design choices and their rationale, and what it is optimised for.",
            (
                A("training methods and techniques"),
                A("key design choices and rationale"),
                A("the training process as it ran: stage, audited steps, health gates", (run_steps, gate_progression)),
                A("what the model was optimised for, as measured (canary NLL)", (nll_series,)),
                A("training stability: per-expert gradient-variance envelope", (envelope,)),
            ),
        ),
        Item(
            "Annex XI §1.2(c)",
            "Describe the data used for training, testing and validation: "
            "type, provenance, curation, size, scope, how it was obtained and selected, and how "
            "unsuitable sources and biases were detected.",
            (
                A("training data: type, provenance, curation, size, selection"),
                A("test data: type, size and scope", (canary,)),
                A("detection of unsuitable sources and biases"),
            ),
            note="Only the canary (evaluation data) is described: digest, shape, domain names.",
        ),
        Item(
            "Annex XI §1.2(d)",
            "State the compute used to train the model (e.g. floating-point "
            "operations), the training time and other relevant training details.",
            (A("training compute (e.g. FLOPs)"), A("training time")),
            context=(
                (run_steps, "step numbers of the audited checkpoints, not compute or time"),
                (environment, "the audit replay environment, not the training job"),
            ),
        ),
        Item(
            "Annex XI §1.2(e)", "State the model's known or estimated energy consumption.", (A("energy consumption"),)
        ),
    ),
)

NIST_AI_600_1 = Framework(
    "nist-ai-600-1",
    "NIST AI 600-1 — Generative AI Profile, suggested actions",
    "NIST AI 600-1, Artificial Intelligence Risk Management Framework: Generative Artificial "
    "Intelligence Profile (July 2024), MEASURE suggested actions",
    "Voluntary guidance; action texts paraphrased from the July 2024 final (the April 2024 draft "
    "numbered some actions differently). " + SCOPE,
    (
        Item(
            "MS-2.3-003",
            "Share pre-deployment test results with the relevant actors, such as "
            "those with authority to approve release.",
            (
                A(
                    "pre-deployment test results as a shareable, verifiable record",
                    (verdict, gate_progression) + SIGNED,
                ),
                A("delivery to the people who approve release"),
            ),
            note="`moeaudit gate` turns the same evidence into a CI exit code; who received "
            "the results is not recorded.",
        ),
        Item(
            "MS-2.7-005",
            "Measure how reliable content-authentication and integrity methods "
            "are (watermarks, cryptographic signatures, fingerprints, access controls, model "
            "integrity checks), including their false-positive and false-negative rates.",
            (
                A("cryptographic signature over the results", SIGNED),
                A("model integrity: digests of the audited checkpoints", (subjects,)),
                A("measured reliability (false-positive and false-negative rates)"),
                A("watermarking or fingerprinting of generated content"),
            ),
            note="moeaudit's test suite checks that any flipped byte fails verification; that "
            "is a property of the tool, not evidence in this certificate.",
        ),
        Item(
            "MS-2.9-002",
            "Document the model's details: intended use and value, assumptions and "
            "limitations, data collection, provenance and quality, architecture, optimisation "
            "objectives, training and fine-tuning approaches, evaluation data, and ethical and "
            "legal considerations.",
            (
                A("intended use and organisational value"),
                A("limitations of each measurement and of each gate's claims", (claims,)),
                A("data collection, provenance and quality"),
                A("model architecture"),
                A("training process: stage, audited steps, resumes", (run_steps, events)),
                A("evaluation data", (canary,)),
                A("ethical, legal and regulatory considerations"),
            ),
        ),
        Item(
            "MS-2.13-001",
            "Build measurement-error models for pre-deployment metrics that show "
            "each metric measures what it is meant to, estimating and documenting the metrics' "
            "bias and statistical variance.",
            (
                A("statistical variance of the metrics (window-bootstrap 95% intervals)", (ci95,)),
                A("construct validity: what each metric measures and cannot show", (claims,)),
                A("bias of the metrics or of human feedback processes"),
            ),
        ),
        Item(
            "MS-4.2-005",
            "Verify and document how the results of structured public feedback "
            "feed into design, deployment go/no-go, monitoring and decommissioning decisions.",
            (
                A("results of structured public feedback exercises"),
                A("their use in go/no-go, monitoring and decommissioning decisions"),
            ),
            context=((verdict, "a go/no-go input from measurements; no public feedback in it"),),
        ),
    ),
)

SR_11_7 = Framework(
    "sr-11-7",
    "SR 11-7 model-risk vocabulary",
    "Board of Governors of the Federal Reserve System, SR 11-7, Supervisory Guidance on Model "
    "Risk Management (April 2011): the three core elements of model validation",
    "SR 11-7 was superseded by SR 26-2 in April 2026 (Federal Reserve, OCC and FDIC, 17 April "
    "2026), and SR 26-2 places generative AI and agentic AI models outside its scope: a generative "
    "MoE language model, the kind moeaudit audits, is not a model under SR 26-2. This export uses "
    "SR 11-7's vocabulary, still common in model-risk practice, as a shared language only; it "
    "claims neither that SR 11-7 still applies nor that SR 26-2 covers the model. " + SCOPE,
    (
        Item(
            "conceptual soundness",
            "Assess the quality of the model's design and construction, "
            "with documented evidence for its methods, assumptions and limitations.",
            (
                A("measurement definitions pinned: tool version, full policy and its digest", (tool, policy)),
                A("assumptions and limits of each measurement", (claims,)),
                A("soundness of the audited model's own design and data"),
            ),
            note="The receipts follow the cited paper equations and the replay is tested "
            "against Hugging Face transformers: properties of the tool version, not "
            "evidence in this certificate.",
        ),
        Item(
            "ongoing monitoring",
            "Keep checking that the model performs as intended over time, "
            "so that changes, degradation or limits are found and acted on.",
            (
                A("gates over checkpoints against a baseline, with escalation", (compared_gates,)),
                A("gradient-signal envelope over the run", (envelope,)),
                A("monitoring in production use"),
            ),
            note="Monitoring here spans the training run, not the deployed model.",
        ),
        Item(
            "outcomes analysis",
            "Compare the model's outputs with actual outcomes (e.g. back-testing) to judge its performance.",
            (
                A("loss on a fixed probe set over training", (nll_series,)),
                A("loss by domain", (nll_by_domain,)),
                A("result against the policy", (verdict,)),
                A("comparison with downstream or real-world outcomes"),
            ),
            note="No downstream outcome data enters the certificate.",
        ),
    ),
)

# --- the Model Documentation Form's audience flags -------------------------------------------------
# The Form "indicates for each item whether the information is intended for downstream providers,
# the AI Office or national competent authorities" (Code of Practice, Transparency chapter,
# introductory note). FORM_FIELDS transcribes those flags field by field from the sources that
# docs/compliance.md ("Two audiences") cites; a flag no source showed is None, and falls back
# explicitly: the AI Office and the national authorities get every field (Art. 53(1)(a): the
# technical documentation, Annex XI, on request), and downstream providers get a field only when
# Annex XII (the information Art. 53(1)(b) owes them) lists its content.


@dataclass(frozen=True)
class FormField:
    title: str  # the Form's field, numbered where the Form numbers it
    aio: bool | None  # the flags as transcribed; None: no source showed this flag
    ncas: bool | None
    dps: bool | None
    annex_xii: bool  # the fallback for a missing DPs flag: Annex XII lists the field's content
    source: str = ""  # where the flags were read (docs/compliance.md, "Two audiences"); "" for none

    def resolved(self) -> tuple[bool, bool, bool]:
        """(AIO, NCAs, DPs): each flag as transcribed, or its explicit fallback where none was found."""
        return (
            True if self.aio is None else self.aio,
            True if self.ncas is None else self.ncas,
            self.annex_xii if self.dps is None else self.dps,
        )

    def audiences(self) -> tuple[str, ...]:
        return tuple(who for who, flag in zip((AIO, NCA, DP), self.resolved(), strict=True) if flag)


# The sources (docs/compliance.md lists their addresses): the AdrianGonzalezSanchez/GPAI dataset,
# a JSON transcription of the Form with AIO/NCAs/DPs booleans per field, read through two mirrors
# of its viewer, and the same transcription's FullModelSpec.json.
_W, _H, _F = "[W]", "[H]", "[F]"
_T, _X = True, False  # a flag as the transcription shows it
FORM_FIELDS: dict[str, FormField] = {
    # 1. General information
    "LegalNameProvider": FormField("1.1 legal name for the model provider", _T, _T, _T, True, f"{_W} {_H} {_F}"),
    "ModelName": FormField("1.2 model name", _T, _T, _T, True, _W),
    "ModelAuthenticity": FormField("1.3 model authenticity", _T, _T, _X, False, _W),
    "ReleaseDate": FormField("1.4 release date", _T, _T, _T, True, _W),
    "UnionMarketReleaseDate": FormField("1.5 Union market release date", _T, _T, _T, True, _W),
    "ModelDependencies": FormField("1.6 model dependencies", _T, _T, _T, False, _W),
    # 2. Model properties
    "Architecture": FormField("2.1 model architecture", _T, _T, _T, True, _H),
    "DesignSpecifications": FormField("2.2 design specifications of the model", None, None, None, False),
    "InputModalities": FormField("input modalities and maximum input size", None, None, None, True),
    "OutputModalities": FormField("output modalities and maximum output size", None, None, None, True),
    "TotalParameters": FormField("total number of parameters", None, None, None, True),
    # 3. Methods of distribution and licences
    "DistributionChannels": FormField("3.1 distribution channels", None, None, None, True),
    "License": FormField("3.2 licence", None, None, None, True),
    # 4. Use
    "AcceptableUsePolicy": FormField("acceptable use policy", _T, _T, _T, True, _H),
    "IntendedUses": FormField("intended or restricted uses", None, None, None, True),
    "AISystemTypes": FormField("type and nature of AI systems the model can be integrated in", None, None, None, True),
    "TechnicalMeans": FormField("technical means, hardware and software for integration", None, None, None, True),
    # Training process
    "TrainingProcess": FormField("design specification of the training process", None, None, None, False),
    # Information on the data used for training, testing and validation
    "DataType": FormField("data type and modality", _T, _T, _T, True, _H),
    "DataProvenance": FormField("provenance of the data", None, None, None, True),
    "DataSelection": FormField("how the data was obtained and selected", None, None, None, False),
    "DataPoints": FormField("number of data points, scope and main characteristics", None, None, None, False),
    "DataCuration": FormField("data curation methodologies", None, None, None, True),
    "UnsuitableData": FormField("measures to detect unsuitable data sources", None, None, None, False),
    "DataBiases": FormField("measures to detect identifiable biases", None, None, None, False),
    # Computational resources
    "TrainingTime": FormField("training time", _T, _T, _X, False, _H),
    "TrainingCompute": FormField("amount of computation used for training", None, None, None, False),
    "ComputeMethodology": FormField("measurement methodology of the computation", None, None, None, False),
    # Energy consumption
    "TrainingEnergy": FormField("amount of energy used for training", _T, None, None, False, _H),
    "EnergyMethodology": FormField("methodology of the energy figure", None, None, None, False),
    "InferenceCompute": FormField("benchmarked computation used for inference", None, None, None, False),
}


def form_aspect(what: str, fields: tuple[str, ...], selectors: tuple[Selector, ...] = ()) -> Aspect:
    """An aspect of the Form that answers ``fields`` (keys of FORM_FIELDS)."""
    unknown = [f for f in fields if f not in FORM_FIELDS]
    if not fields or unknown:
        raise ValueError(f"aspect {what!r} names no Form field, or unknown ones: {unknown}")
    return Aspect(what, selectors, fields=fields)


_AUTHENTICITY = "The subject digests answer the Form's model-authenticity item for the audited checkpoints. "

EU_GPAI_MDF = Framework(
    "eu-ai-act-gpai",
    "EU AI Act for GPAI providers — Code of Practice Model Documentation Form",
    "Code of Practice for General-Purpose AI Models, Transparency chapter (July 2025), Measure 1.1 "
    "and its Model Documentation Form, which gathers what Regulation (EU) 2024/1689 Art. 53(1)(a)-(b) "
    "and Annexes XI and XII ask a provider of a general-purpose AI model to document",
    "For GPAI providers. Items follow the Form's sections and are paraphrased; the Code is voluntary "
    "and adherence to it is not conclusive evidence of compliance. " + _AUTHENTICITY + SCOPE,
    (
        Item(
            "MDF 1.1-1.2 provider and model name",
            "Give the provider's legal name and the model's "
            "unique identifier, with the publicly available versions the documentation covers.",
            (
                form_aspect("provider's legal name", ("LegalNameProvider",)),
                form_aspect("model identifier and the versions covered", ("ModelName",)),
            ),
            context=((subjects, "names the audited checkpoint directories, not the model or its published versions"),),
        ),
        Item(
            "MDF 1.3 model authenticity",
            "Give evidence that establishes the model's provenance "
            "and authenticity, e.g. a secure hash of the distributed binaries.",
            (
                form_aspect(
                    "a secure hash of each audited checkpoint (OpenSSF model-signing root digest)",
                    ("ModelAuthenticity",),
                    (subjects,),
                ),
                form_aspect("signed and dated by the auditing key", ("ModelAuthenticity",), SIGNED),
            ),
            note="Answers the item for the released weights when they are one of the audited "
            "checkpoints: `moeaudit verify --recheck` recomputes the root digests from the "
            "files. A model offered only as a service (an endpoint) is not covered.",
        ),
        Item(
            "MDF 1.4-1.5 release dates",
            "Give the date the model was first released, and the date it was placed on the Union market.",
            (
                form_aspect("first release date", ("ReleaseDate",)),
                form_aspect("Union market release date", ("UnionMarketReleaseDate",)),
            ),
        ),
        Item(
            "MDF 1.6 model dependencies",
            "If the model is a modification or fine-tune of "
            "general-purpose AI models already on the market, name them and their versions.",
            (form_aspect("name and version of each model it was modified or fine-tuned from", ("ModelDependencies",)),),
            context=(
                (run_steps, "the stage says whether the audited run was a fine-tune, not which model it started from"),
                (
                    subjects,
                    "a post-training run's first checkpoint is its starting point, "
                    "pinned by digest but not named as a published model",
                ),
            ),
        ),
        Item(
            "MDF 2 model properties",
            "Describe the architecture and key design specifications "
            "with their rationale, the input and output modalities and sizes, and the total "
            "number of parameters.",
            (
                form_aspect("architecture", ("Architecture",)),
                form_aspect("design specifications, rationale and assumptions", ("DesignSpecifications",)),
                form_aspect("input and output modalities and maximum sizes", ("InputModalities", "OutputModalities")),
                form_aspect(
                    "number of parameters (two significant figures), counted from the weights",
                    ("TotalParameters",),
                    (parameters,),
                ),
            ),
            context=((routed_shape, "the routed layers and experts the replay saw, not an architecture description"),),
        ),
        Item(
            "MDF 3 distribution and licence",
            "List the distribution channels and the licence.",
            (
                form_aspect("distribution channels and access levels", ("DistributionChannels",)),
                form_aspect("licence", ("License",)),
            ),
        ),
        Item(
            "MDF 4 use",
            "Give the acceptable-use policy, the intended or restricted uses, the "
            "AI systems the model can be integrated in, and the technical means, hardware and "
            "software needed to integrate it.",
            (
                form_aspect("acceptable-use policy", ("AcceptableUsePolicy",)),
                form_aspect("intended or restricted uses", ("IntendedUses",)),
                form_aspect("types of AI systems it can be integrated in", ("AISystemTypes",)),
                form_aspect("technical means, hardware and software for integration", ("TechnicalMeans",)),
            ),
        ),
        Item(
            "MDF training process",
            "Describe the main steps of training, the methods and "
            "techniques, the key design choices and assumptions, and what the model was "
            "optimised for (Annex XI §1.2(b)).",
            (
                form_aspect(
                    "training methods, techniques and design choices, with their rationale", ("TrainingProcess",)
                ),
                form_aspect(
                    "the training process as it ran: stage, audited steps, resumes, health gates",
                    ("TrainingProcess",),
                    (run_steps, events, gate_progression),
                ),
                form_aspect(
                    "what the model was optimised for, as measured (canary NLL)", ("TrainingProcess",), (nll_series,)
                ),
                form_aspect(
                    "training stability: per-expert gradient-variance envelope", ("TrainingProcess",), (envelope,)
                ),
            ),
        ),
        Item(
            "MDF data for training, testing and validation",
            "Describe the data: type, "
            "provenance, how it was obtained and selected, number of data points, scope, curation, "
            "and the measures to detect unsuitable sources and identifiable biases (Annex XI "
            "§1.2(c)).",
            (
                form_aspect("training data: type and modality", ("DataType",)),
                form_aspect("training data: provenance and curation", ("DataProvenance", "DataCuration")),
                form_aspect(
                    "training data: how it was obtained and selected, its size and scope",
                    ("DataSelection", "DataPoints"),
                ),
                form_aspect("test and validation data: type, size and scope", ("DataType", "DataPoints"), (canary,)),
                form_aspect("detection of unsuitable data sources", ("UnsuitableData",)),
                form_aspect("detection of identifiable biases", ("DataBiases",)),
            ),
            note="Only the canary (evaluation data) is described: digest, shape, domain names.",
        ),
        Item(
            "MDF computational resources",
            "State the training time, the amount of computation "
            "used to train (e.g. floating-point operations) and how it was measured (Annex XI "
            "§1.2(d)).",
            (
                form_aspect("training time", ("TrainingTime",)),
                form_aspect("training compute (e.g. FLOPs)", ("TrainingCompute",)),
                form_aspect("measurement methodology", ("ComputeMethodology",)),
                form_aspect(
                    "the audit's own compute: FLOPs counted in its replays, by receipt",
                    ("TrainingCompute", "ComputeMethodology"),
                    (audit_flops,),
                ),
            ),
            context=(
                (run_steps, "step numbers of the audited checkpoints, not compute or time"),
                (environment, "the audit replay environment, not the training job"),
            ),
        ),
        Item(
            "MDF energy consumption",
            "State the energy used to train the model and how it was "
            "measured or estimated, and the computation used for inference (Annex XI §1.2(e)).",
            (
                form_aspect("training energy and its methodology", ("TrainingEnergy", "EnergyMethodology")),
                form_aspect("inference computation", ("InferenceCompute",)),
                form_aspect(
                    "the audit's own energy: measured by NVML on its GPU, by receipt",
                    ("TrainingEnergy", "EnergyMethodology"),
                    (audit_energy,),
                ),
            ),
        ),
    ),
)


def _flagged(fw: Framework) -> Framework:
    """``fw`` with each aspect carrying the Form's audience flags: those every Form field it
    answers is flagged for (FORM_FIELDS), so that no audience gets a field flagged not for it."""

    def flags(aspect: Aspect) -> tuple[str, ...]:
        each = [set(FORM_FIELDS[f].audiences()) for f in aspect.fields]
        return tuple(who for who in (AIO, NCA, DP) if all(who in s for s in each))

    items = tuple(
        replace(item, aspects=tuple(replace(a, audiences=flags(a)) for a in item.aspects)) for item in fw.items
    )
    return replace(fw, items=items)


EU_GPAI_MDF = _flagged(EU_GPAI_MDF)
# audience → (the flags that admit an aspect to its export, its label)
AUDIENCES: dict[str, tuple[tuple[str, ...], str]] = {
    "authority": ((AIO, NCA), "the AI Office and national competent authorities"),
    "downstream": ((DP,), DP),
}


def for_audience(fw: Framework, audience: str) -> Framework:
    """The Form's fields for one audience: the aspects flagged for it (the authority export: AIO
    or NCAs; the downstream export: DPs), items left without one dropped. Both audiences' exports
    of a certificate bind the same certificate digest."""
    admit, label = AUDIENCES[audience]
    items = []
    for item in fw.items:
        kept = tuple(a for a in item.aspects if any(who in a.audiences for who in admit))
        if kept:
            items.append(replace(item, aspects=kept))
    return replace(
        fw,
        key=f"{fw.key}-{audience}",
        title=f"{fw.title}, for {label}",
        note=f"The fields the Form flags for {label}. "
        + (fw.note if any(i.id.startswith("MDF 1.3") for i in items) else fw.note.replace(_AUTHENTICITY, "")),
        items=tuple(items),
        audience=label,
    )


ISO_42001 = Framework(
    "iso-42001",
    "ISO/IEC 42001 — Annex A controls",
    "ISO/IEC 42001:2023, Information technology — Artificial intelligence — Management system, "
    "Annex A (normative): reference control objectives and controls",
    "A management-system standard: the controls are the organization's, and a certificate is "
    "evidence it can cite for some of them, never a certification. Control texts are paraphrased. " + SCOPE,
    (
        Item(
            "A.6.2.4 verification and validation",
            "Define and document verification and validation measures for the AI system, and the "
            "criteria for their use.",
            (
                A("verification and validation measures, applied gate by gate", (gate_progression, gate_metrics)),
                A("criteria for their use: the acceptance thresholds, pinned by digest", (policy,)),
                A("the criteria fixed before the evidence they judge (a preregistration)", (preregistration,)),
                A("results against the criteria", (verdict,)),
                A("validation of the deployed system for its intended use"),
            ),
            note="The policy is the criteria: every constant of it is signed with its digest.",
        ),
        Item(
            "A.6.2.6 operation and monitoring",
            "Define and document what the ongoing operation of the AI system needs: at least "
            "system and performance monitoring, repairs, updates and support.",
            (
                A("monitoring of the training run: the per-expert gradient-signal envelope", (envelope,)),
                A("the training callback's logs the monitoring read, bound by digest", (monitoring_logs,)),
                A("changes flagged against the active baseline", (compared_gates,)),
                A("monitoring, repair, update and support of the system in operation"),
            ),
            note="Covers the training run the callback logged; operation after release is outside the certificate.",
        ),
        Item(
            "A.6.2.7 technical documentation",
            "Determine the technical documentation each category of interested party needs "
            "(users, partners, authorities) and provide it in a suitable form.",
            (
                A("what each measurement shows and does not license", (claims,)),
                A("the tool version and the policy the results rest on", (tool, policy)),
                A("the documented model: its checkpoints and their files, by digest", (subjects, checkpoint_files)),
                A("the model's size, counted from its weights", (parameters,)),
                A("documentation for each category of interested party"),
            ),
            note="`moeaudit export` renders the same signed evidence for several audiences.",
        ),
        Item(
            "A.6.2.8 recording of event logs",
            "Determine at which phases of the AI system life cycle event logs are kept, at least "
            "while the system is in use.",
            (
                A("a signed, dated record of each audit", SIGNED),
                A("per-checkpoint receipts, retained inside the signed statement", (gate_metrics,)),
                A("resumes and regime changes of the run, recorded", (events,)),
                A("event logs of the system in use, and their retention period"),
            ),
            note="Only the gates' receipts are signed; receipts/*.json beside the certificate are not.",
        ),
        Item(
            "A.7.5 data provenance",
            "Define and document how the provenance of the data used in the AI system is recorded "
            "over the life cycles of the data and of the system.",
            (
                A("the evaluation data (canary), pinned by digest", (canary,)),
                A("provenance of the training data"),
                A("the data's life cycle: its changes, transformations and sharing"),
            ),
            note="The canary is an evaluation probe set, not training data.",
        ),
    ),
)

FRAMEWORKS: dict[str, Framework] = {
    f.key: f
    for f in (
        EU_AI_ACT,
        EU_GPAI_MDF,
        for_audience(EU_GPAI_MDF, "authority"),
        for_audience(EU_GPAI_MDF, "downstream"),
        ISO_42001,
        NIST_AI_600_1,
        SR_11_7,
    )
}
