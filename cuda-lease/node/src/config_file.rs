//! The programs' TOML config file: each setting is a flag's long name
//! (`listen = "0.0.0.0:7070"`, `admin = ["ops"]`), passed through the
//! flag's environment variable. Precedence: command line, environment, file.

use std::ffi::OsString;
use std::path::PathBuf;

/// Reads the file named by `--config FILE` (or `--config=FILE`) in `args`,
/// else by variable `env`, and sets each setting's flag's environment
/// variable in `cmd` (`-` and `_` alike) unless already set. Returns the
/// file read, if any. Call it first in `main`, before any thread starts.
///
/// # Errors
/// The file cannot be read or is not TOML; a setting names no flag, or a
/// flag without an environment variable; a value is a table.
///
/// # Examples
///
/// ```
/// use clap::{CommandFactory, Parser};
///
/// #[derive(Parser)]
/// struct Args {
///     #[arg(long, env = "DOC_EXAMPLE_NAME", default_value = "node")]
///     name: String,
///     #[arg(long, env = "DOC_EXAMPLE_CONFIG")]
///     config: Option<std::path::PathBuf>,
/// }
///
/// let dir = std::env::temp_dir().join("cuda-lease-config-doc");
/// std::fs::create_dir_all(&dir).unwrap();
/// let file = dir.join("node.toml");
/// std::fs::write(&file, "name = \"gpu-7\"\n").unwrap();
/// let argv = vec!["prog".into(), "--config".into(), file.clone().into_os_string()];
/// cuda_lease_node::config_file::load_into_env(&Args::command(), &argv, "DOC_EXAMPLE_CONFIG").unwrap();
/// assert_eq!(Args::parse_from(&argv).name, "gpu-7");
/// ```
pub fn load_into_env(
    cmd: &clap::Command,
    args: &[OsString],
    env: &str,
) -> Result<Option<PathBuf>, String> {
    let Some(path) = config_path(args).or_else(|| std::env::var_os(env).map(PathBuf::from)) else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("config file {}: {e}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| format!("config file {}: {e}", path.display()))?;
    let mut settings = Vec::with_capacity(table.len());
    for (key, value) in &table {
        let name = key.replace('_', "-");
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(name.as_str()))
            .ok_or_else(|| {
                format!(
                    "config file {}: unknown setting `{key}` (settings are the flags' long \
                     names, as `--help` lists them)",
                    path.display()
                )
            })?;
        let var = arg.get_env().ok_or_else(|| {
            format!(
                "config file {}: `{key}` cannot be set from a file",
                path.display()
            )
        })?;
        settings.push((var.to_owned(), text_of(key, value, &path)?));
    }
    // Checked whole before any is set.
    for (var, value) in settings {
        if std::env::var_os(&var).is_none() {
            std::env::set_var(var, value);
        }
    }
    Ok(Some(path))
}

/// `--config FILE` or `--config=FILE` in `args`.
fn config_path(args: &[OsString]) -> Option<PathBuf> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(v) = a.to_str().and_then(|s| s.strip_prefix("--config=")) {
            return Some(PathBuf::from(v));
        }
    }
    None
}

/// A setting's value as its flag takes it (a list joined with `,`).
fn text_of(key: &str, value: &toml::Value, path: &std::path::Path) -> Result<String, String> {
    Ok(match value {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(n) => n.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Array(items) => items
            .iter()
            .map(|v| text_of(key, v, path))
            .collect::<Result<Vec<_>, _>>()?
            .join(","),
        _ => {
            return Err(format!(
                "config file {}: `{key}` must be a string, a number, a boolean or a list",
                path.display()
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_config_flag_is_found_in_both_spellings() {
        assert_eq!(
            config_path(&os(&["p", "--config", "a.toml"])),
            Some("a.toml".into())
        );
        assert_eq!(
            config_path(&os(&["p", "--x", "--config=b.toml"])),
            Some("b.toml".into())
        );
        assert_eq!(config_path(&os(&["p", "--x"])), None);
    }

    #[test]
    fn settings_become_flag_values_and_unknown_ones_are_named() {
        let cmd = clap::Command::new("p")
            .arg(clap::Arg::new("admin").long("admin").env("CFG_TEST_ADMIN"))
            .arg(
                clap::Arg::new("max-ttl")
                    .long("max-ttl")
                    .env("CFG_TEST_MAX_TTL"),
            )
            .arg(clap::Arg::new("plain").long("plain"));
        let dir = std::env::temp_dir().join(format!("cuda-lease-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.toml");
        std::fs::write(&good, "admin = [\"ops\", \"sre\"]\nmax_ttl = \"2h\"\n").unwrap();
        std::env::set_var("CFG_TEST_MAX_TTL", "30s");
        let argv = os(&["p", "--config", good.to_str().unwrap()]);
        assert_eq!(load_into_env(&cmd, &argv, "CFG_TEST_NONE"), Ok(Some(good)));
        assert_eq!(std::env::var("CFG_TEST_ADMIN").unwrap(), "ops,sre");
        assert_eq!(
            std::env::var("CFG_TEST_MAX_TTL").unwrap(),
            "30s",
            "the environment beats the file"
        );
        for (text, want) in [
            ("bogus = 1\n", "unknown setting `bogus`"),
            ("plain = 1\n", "`plain` cannot be set from a file"),
            ("admin = { a = 1 }\n", "must be a string"),
            ("admin = [\n", "config file"),
        ] {
            let bad = dir.join("bad.toml");
            std::fs::write(&bad, text).unwrap();
            let argv = os(&["p", "--config", bad.to_str().unwrap()]);
            let e = load_into_env(&cmd, &argv, "CFG_TEST_NONE").unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}
