// Unit tests of the pure modules (contract.ts, format.ts, state.ts, share.ts, derive.ts, ...): plain Node,
// no JupyterLab, no DOM.
module.exports = {
  testEnvironment: 'node',
  roots: ['<rootDir>/test'],
  transform: {
    '^.+\\.tsx?$': ['ts-jest', { tsconfig: 'tsconfig.test.json' }]
  }
};
