# Source this on an offline GPU machine to use an SGLang bundle with the megatron-fp4 plug-in:
#
#   source tools/sglang_bundle_env.sh BUNDLE_DIR [TARGET_DIR]
#
# BUNDLE_DIR holds what ../shared/tools/build_sglang_bundle.sh wrote (sglang-*.tar.xz and its pinned wheels).
# The bundle is unpacked once into TARGET_DIR (default /tmp/sglang-bundle; kept between calls on a warm machine),
# the plug-in's `sglang.srt.plugins` entry point is registered there (a metadata-only dist-info pointing at this
# checkout's megatron_fp4, so SGLang's scheduler processes load the plug-in from the checkout itself), and
# PYTHONPATH gets the checkout first, then the bundle.
_mf4_bundle=${1:?usage: source tools/sglang_bundle_env.sh BUNDLE_DIR [TARGET_DIR]}
_mf4_target=${2:-/tmp/sglang-bundle}
_mf4_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ ! -f "$_mf4_target/.unpacked" ]; then
  mkdir -p "$_mf4_target" &&
    tar -xJf "$_mf4_bundle"/sglang-*.tar.xz -C "$_mf4_target" &&
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$_mf4_target" \
      "$_mf4_bundle"/*.whl &&
    touch "$_mf4_target/.unpacked" || { echo "sglang_bundle_env.sh: unpacking $_mf4_bundle failed" >&2; return 1; }
fi
_mf4_version=$(sed -n 's/.*version="\([^"]*\)".*/\1/p' "$_mf4_root/setup.py" | head -1)
_mf4_info="$_mf4_target/megatron_fp4-${_mf4_version}.dist-info"
mkdir -p "$_mf4_info"
printf 'Metadata-Version: 2.1\nName: megatron-fp4\nVersion: %s\n' "$_mf4_version" > "$_mf4_info/METADATA"
sed -n '/entry_points=/s/.*"sglang.srt.plugins": \["\([^"]*\)"\].*/[sglang.srt.plugins]\n\1/p' \
  "$_mf4_root/setup.py" > "$_mf4_info/entry_points.txt"
grep -q "megatron_fp4 = megatron_fp4.sglang_plugin:register" "$_mf4_info/entry_points.txt" ||
  { echo "sglang_bundle_env.sh: could not read the plug-in's entry point from setup.py" >&2; return 1; }
export PYTHONPATH="$_mf4_root:$_mf4_target${PYTHONPATH:+:$PYTHONPATH}"
unset _mf4_bundle _mf4_target _mf4_root _mf4_version _mf4_info
