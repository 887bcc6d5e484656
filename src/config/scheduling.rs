//! The scheduler: prefix index, cost weights, booked load.
//!
//! The cost terms' weight flags are not listed here: each term declares its
//! own ([`crate::scheduler::plugin::Knob`]) and [`WeightFlags`] makes a flag
//! of every declaration in the registry, in its order (the terms' weights,
//! then their prefill-side weights). The storage tiers' load costs are
//! declared the same way ([`crate::scheduler::tiers`], [`TierCostFlags`]).

use std::time::Duration;

use clap::{Arg, ArgMatches, Command, FromArgMatches};

use super::duration;
use crate::kv::index::IndexConfig;
use crate::scheduler::plugin::{Knob, Weight};
use crate::scheduler::tiers::{self, TierCosts};
use crate::scheduler::{registry, Plugins, TermWeights};

/// The scheduler: prefix index, cost weights, booked load.
#[derive(Debug, Clone, clap::Args)]
pub struct SchedulingFlags {
    /// Expected output tokens of a request without `nvext.agent_hints.osl`; the
    /// expected decode blocks count in the decode rank's booked load.
    #[arg(long, env = "KVPICK_DEFAULT_OSL_TOKENS", default_value_t = 0)]
    pub default_osl_tokens: u32,

    /// Most load one request may book on a worker, in blocks (prompt plus
    /// expected output; a block is 64 bytes of text or 16 tokens by default).
    #[arg(long, env = "KVPICK_MAX_REQUEST_LOAD_BLOCKS",
          default_value_t = crate::scheduler::DEFAULT_MAX_REQUEST_LOAD_BLOCKS)]
    pub max_request_load_blocks: u64,

    /// Bootstrap port of `sglang` prefill pods without a `kvpick.io/bootstrap-port`
    /// annotation (SGLang's default); 0 sends no bootstrap headers for them.
    #[arg(long, env = "KVPICK_SGLANG_BOOTSTRAP_PORT", default_value_t = 8998)]
    pub sglang_bootstrap_port: u16,

    /// Text prefix block size in bytes (about 4 bytes a token: 64 ≈ 16 tokens).
    #[arg(long, env = "KVPICK_PREFIX_BYTE_BLOCK", default_value_t = 64)]
    pub prefix_byte_block: usize,

    /// Prefix block size in tokens for prompts given as token ids (the engine's
    /// KV block size).
    #[arg(long, env = "KVPICK_PREFIX_TOKEN_BLOCK", default_value_t = 16)]
    pub prefix_token_block: usize,

    /// Most prompt tokens prefix matching hashes and looks up (the llm-d Router's
    /// `maxPrefixTokensToMatch`); the blocks past them count as uncached. In
    /// blocks: this over `--prefix-token-block` (a text block of
    /// `--prefix-byte-block` bytes counts as one block). 0: the whole prompt.
    #[arg(long, env = "KVPICK_MAX_PREFIX_TOKENS", default_value_t = crate::scheduler::DEFAULT_MAX_PREFIX_TOKENS)]
    pub max_prefix_tokens: usize,

    /// Approximate prefix index: blocks remembered per worker rank until its
    /// scraped KV capacity is known.
    #[arg(long, env = "KVPICK_PREFIX_CAPACITY_BLOCKS", default_value_t = 31_250)]
    pub prefix_capacity_blocks: usize,

    /// Approximate prefix index: seconds an entry stays valid after its last use
    /// on a rank whose KV capacity is not scraped (0: no expiry, LRU only). Once
    /// the engine's capacity bounds a rank's LRU, its entries do not expire.
    /// A bare number counts seconds; `90s`, `15m`, `1h` also work.
    #[arg(long, env = "KVPICK_PREFIX_TTL_SECS", default_value = "900", value_parser = duration::secs)]
    pub prefix_ttl_secs: Duration,

    /// Precise workers: seconds a routed prompt counts as held there
    /// (provisional entries) at most, from its first routing (the requests it
    /// attracts do not renew it); its blocks' KV events end it sooner.
    /// A bare number counts seconds; `90s`, `15m`, `1h` also work.
    #[arg(long, env = "KVPICK_PROVISIONAL_TTL_SECS", default_value = "120", value_parser = duration::secs)]
    pub provisional_ttl_secs: Duration,

    /// Precise workers: how long after a request's response began (or it
    /// ended without one) the worker's KV events have to report the prompt's
    /// blocks; what they have not reported is no longer counted there.
    /// A bare number counts milliseconds; `2s`, `500ms` also work.
    #[arg(long, env = "KVPICK_PROVISIONAL_CONFIRM_MS", default_value = "2000", value_parser = duration::millis)]
    pub provisional_confirm_ms: Duration,

    /// Precise prefix index: KV-event blocks kept per worker rank until its engine's
    /// block count is scraped (then `num_gpu_blocks` × `--prefix-precise-slack`);
    /// stores beyond the cap are dropped and counted.
    #[arg(
        long,
        env = "KVPICK_PREFIX_PRECISE_MAX_BLOCKS",
        default_value_t = 1_000_000
    )]
    pub prefix_precise_max_blocks: usize,

    /// Precise prefix index: the cap per worker rank is the engine's scraped
    /// `num_gpu_blocks` times this (at least 1).
    #[arg(long, env = "KVPICK_PREFIX_PRECISE_SLACK", default_value_t = 1.5)]
    pub prefix_precise_slack: f64,

    /// The cost terms' `--weight-*` flags, one per weight a term declares.
    #[command(flatten)]
    pub weights: WeightFlags,

    /// The `--tier-cost-*` flags: what loading a block from a lower storage
    /// tier costs.
    #[command(flatten)]
    pub tier_costs: TierCostFlags,

    /// 0 picks the cheapest candidate; above 0, softmax sampling over costs scaled
    /// to [0, 1] with this temperature.
    #[arg(long, env = "KVPICK_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f64,

    /// Endpoints each decision names in `x-gateway-destination-endpoint` (and
    /// its `envoy.lb` metadata), comma-separated in cost order: the pick, then
    /// fallbacks at other addresses the gateway's retries try in turn. An
    /// `EndpointPickerConfig` picker's `maxNumOfEndpoints` overrides it.
    #[arg(long, env = "KVPICK_MAX_ENDPOINTS", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub max_endpoints: u32,

    /// What a candidate's cost is in: `heuristic` (KV blocks of work, from the
    /// `--weight-*` terms) or `predicted` (seconds, from per-worker latency
    /// models learned online from streamed responses; the heuristic decides
    /// while they are cold).
    #[arg(long, env = "KVPICK_SCORING", value_enum, default_value_t = Scoring::Heuristic)]
    pub scoring: Scoring,

    /// The scheduler's plugin list an `EndpointPickerConfig` built (not a flag).
    #[arg(skip)]
    pub plugins: Option<Plugins>,
}

/// `--scoring`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scoring {
    /// KV blocks of work, from the weighted terms.
    Heuristic,
    /// Predicted seconds, from latency learned online.
    Predicted,
}

impl Scoring {
    /// The scheduler's mode.
    pub fn mode(self) -> crate::scheduler::ScoringMode {
        match self {
            Scoring::Heuristic => crate::scheduler::ScoringMode::Heuristic,
            Scoring::Predicted => crate::scheduler::ScoringMode::Predicted,
        }
    }
}

impl SchedulingFlags {
    /// The plugin list to schedule with: the `EndpointPickerConfig`'s, else
    /// every term at its flag weight and the default picker at `--temperature`.
    pub fn plugins(&self) -> Plugins {
        match &self.plugins {
            Some(p) => p.clone(),
            None => Plugins::with_weights(&self.weights.0, self.temperature.max(0.0)),
        }
    }

    /// Longest prefix matched, in blocks (`usize::MAX`: the whole prompt).
    pub fn max_prefix_blocks(&self) -> usize {
        match self.max_prefix_tokens {
            0 => usize::MAX,
            t => (t / self.prefix_token_block.max(1)).max(1),
        }
    }

    /// The prefix index settings these flags describe.
    pub fn index(&self) -> IndexConfig {
        IndexConfig {
            default_capacity: self.prefix_capacity_blocks,
            ttl: (!self.prefix_ttl_secs.is_zero()).then_some(self.prefix_ttl_secs),
            default_precise_limit: self.prefix_precise_max_blocks,
            precise_slack: self.prefix_precise_slack.max(1.0),
            // kvpick's block hashes and the engines' are chained.
            chained: true,
        }
    }
}

/// The weight flags of every declared cost term, read into [`TermWeights`].
#[derive(Debug, Clone, Default)]
pub struct WeightFlags(pub TermWeights);

/// Every weight flag the registry's terms declare: their weights, then their
/// prefill-side weights.
fn knobs() -> impl Iterator<Item = Knob> {
    let weights = registry::terms().filter_map(|t| match t.weight {
        Weight::Flag(k) => Some(k),
        Weight::Fixed(_) => None,
    });
    weights.chain(registry::terms().filter_map(|t| t.prefill_weight))
}

/// The flag of `knob`, as `#[arg(long, env, default_value_t)]` would make it.
fn flag(knob: Knob) -> Arg {
    Arg::new(knob.flag)
        .long(knob.flag)
        .env(knob.env)
        .value_name(knob.flag.to_ascii_uppercase().replace('-', "_"))
        .value_parser(clap::value_parser!(f64))
        .default_value(knob.default.to_string())
        .help(knob.help)
}

impl FromArgMatches for WeightFlags {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut flags = WeightFlags::default();
        flags.update_from_arg_matches(matches)?;
        Ok(flags)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        for k in knobs() {
            if let Some(v) = matches.get_one::<f64>(k.flag) {
                self.0.set_flag(k.flag, *v);
            }
        }
        Ok(())
    }
}

impl clap::Args for WeightFlags {
    fn augment_args(cmd: Command) -> Command {
        knobs().fold(cmd, |cmd, k| cmd.arg(flag(k)))
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

/// The `--tier-cost-*` flags the scheduler's tier module declares
/// ([`crate::scheduler::tiers::KNOBS`]), read into [`TierCosts`].
#[derive(Debug, Clone, Default)]
pub struct TierCostFlags(pub TierCosts);

impl FromArgMatches for TierCostFlags {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut flags = TierCostFlags::default();
        flags.update_from_arg_matches(matches)?;
        Ok(flags)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        for k in tiers::KNOBS {
            if let Some(v) = matches.get_one::<f64>(k.flag) {
                self.0.set_flag(k.flag, *v);
            }
        }
        Ok(())
    }
}

impl clap::Args for TierCostFlags {
    fn augment_args(cmd: Command) -> Command {
        tiers::KNOBS.iter().fold(cmd, |cmd, k| cmd.arg(flag(**k)))
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}
