//! The Landlock ruleset: read and execute everywhere, everything in the writable places.

use std::path::{Path, PathBuf};

use landlock::{
    ABI, Access, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, PathBeneath, PathFd,
    Ruleset, RulesetAttr, RulesetCreated, RulesetCreatedAttr, RulesetStatus, Scope,
};

use crate::error::SandboxError;

/// The newest ABI this code knows; rights the kernel lacks beyond [`crate::MIN_LANDLOCK_ABI`]
/// are dropped (best effort), those up to it are required.
const NEWEST: ABI = ABI::V9;

/// Character devices the command may open for writing.
const DEVICES: [&str; 6] = [
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
];

/// The highest ABI whose restrictions the kernel accepts, by trying rulesets (no restriction
/// is applied). 0 when Landlock is missing or disabled.
pub(crate) fn probe_abi() -> u8 {
    let levels: [(ABI, u8); 7] = [
        (ABI::V9, 9),
        (ABI::V6, 6),
        (ABI::V5, 5),
        (ABI::V4, 4),
        (ABI::V3, 3),
        (ABI::V2, 2),
        (ABI::V1, 1),
    ];
    for (abi, n) in levels {
        if accepts(abi, n) {
            return n;
        }
    }
    0
}

fn accepts(abi: ABI, n: u8) -> bool {
    let attempt = || -> Result<RulesetCreated, landlock::RulesetError> {
        let mut r = Ruleset::default()
            .set_compatibility(CompatLevel::HardRequirement)
            .handle_access(AccessFs::from_all(abi))?;
        if n >= 4 {
            r = r.handle_access(AccessNet::from_all(abi))?;
        }
        if n >= 6 {
            r = r.scope(Scope::from_all(abi))?;
        }
        r.create()
    };
    attempt().is_ok()
}

/// Builds (but does not apply) the ruleset: opening the paths may need the capabilities that
/// are dropped before [`apply`].
pub(crate) fn build(writable: &[PathBuf]) -> Result<RulesetCreated, SandboxError> {
    let ll = |e: landlock::RulesetError| SandboxError::Landlock(e.to_string());
    let min = ABI::from(i32::from(crate::MIN_LANDLOCK_ABI));
    let all = AccessFs::from_all(NEWEST);
    let read = AccessFs::from_read(NEWEST);
    let device: BitFlags<AccessFs> =
        AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::Truncate | AccessFs::IoctlDev;
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(min))
        .map_err(|e| match e {
            landlock::RulesetError::HandleAccesses(_)
            | landlock::RulesetError::CreateRuleset(_) => {
                SandboxError::LandlockUnavailable { abi: probe_abi() }
            }
            other => ll(other),
        })?
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(all)
        .map_err(ll)?
        .scope(Scope::from_all(NEWEST))
        .map_err(ll)?
        .create()
        .map_err(|e| match e {
            landlock::RulesetError::CreateRuleset(_) => {
                SandboxError::LandlockUnavailable { abi: probe_abi() }
            }
            other => ll(other),
        })?;
    ruleset = ruleset
        .add_rule(PathBeneath::new(open(Path::new("/"))?, read))
        .map_err(ll)?;
    for dir in writable {
        ruleset = ruleset
            .add_rule(PathBeneath::new(open(dir)?, all))
            .map_err(ll)?;
    }
    for dev in DEVICES {
        let path = Path::new(dev);
        if path.exists() {
            ruleset = ruleset
                .add_rule(PathBeneath::new(open(path)?, device))
                .map_err(ll)?;
        }
    }
    Ok(ruleset)
}

fn open(path: &Path) -> Result<PathFd, SandboxError> {
    PathFd::new(path).map_err(|e| {
        SandboxError::Landlock(format!("cannot open {} for a rule: {e}", path.display()))
    })
}

/// Restricts the calling process (no_new_privs must already be set).
pub(crate) fn apply(ruleset: RulesetCreated) -> Result<(), SandboxError> {
    let status = ruleset
        .restrict_self()
        .map_err(|e| SandboxError::Landlock(e.to_string()))?;
    if status.ruleset == RulesetStatus::NotEnforced {
        return Err(SandboxError::LandlockUnavailable { abi: probe_abi() });
    }
    Ok(())
}
